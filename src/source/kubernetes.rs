//! Istio resources as operators keep them in Git: Kubernetes objects
//! (`apiVersion`, `kind`, `metadata`, `spec`), one per YAML document or many
//! under `kind: List`, read by the files source. The kind selects the
//! collection (the table's GVKs, every alias); the `spec` is encoded by the
//! kind's own Istio proto (`proto_json`), so Pilot and istiod decode what
//! they are sent. `status` and the other metadata fields are ignored.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::files::{YamlString, YamlValue, STRUCT_TYPE_URL};
use super::proto_json::{self, PathStep};
use crate::collections::CollectionTable;
use crate::SharedStr;

/// A Kubernetes object's fields, as the files source reads them from a
/// document (or from an item of a `List`).
#[derive(Debug, Default)]
pub(super) struct Object {
    pub(super) api_version: Option<String>,
    pub(super) kind: Option<String>,
    pub(super) metadata: Option<ObjectMeta>,
    pub(super) spec: Option<YamlValue>,
    pub(super) items: Option<Vec<Item>>,
}

/// An item of a `kind: List`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Item {
    #[serde(default, rename = "apiVersion")]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    metadata: Option<ObjectMeta>,
    #[serde(default)]
    spec: Option<YamlValue>,
    #[serde(default)]
    #[allow(dead_code)] // read and ignored, as Galley did
    status: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    items: Option<Vec<Item>>,
}

/// `metadata`: what MCP carries; the rest (`uid`, `resourceVersion`,
/// `creationTimestamp`, ...) is ignored, as `kubectl get -o yaml` writes it.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ObjectMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    labels: BTreeMap<YamlString, YamlString>,
    #[serde(default)]
    annotations: BTreeMap<YamlString, YamlString>,
}

/// The namespace of a namespaced object that names none (as `kubectl apply`).
const DEFAULT_NAMESPACE: &str = "default";

/// One resource read from an object.
#[derive(Debug)]
pub(super) struct Read {
    pub(super) collection: SharedStr,
    /// `namespace/name`, or `name` for a cluster-scoped kind.
    pub(super) name: String,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) annotations: BTreeMap<String, String>,
    pub(super) body: prost_types::Any,
    /// Where the object is in the document (an item of a `List`: `items[2]`).
    pub(super) at: Vec<PathStep>,
}

/// Why an object cannot be read, and the path of what is wrong in the
/// document.
#[derive(Debug)]
pub(super) struct ObjectError {
    pub(super) reason: String,
    pub(super) path: Vec<PathStep>,
}

impl Object {
    /// The resources this object holds (itself, or the items of a `List`),
    /// and why it or an item cannot be read: up to `max_errors` reasons,
    /// each item of a `List` read past an item that fails.
    pub(super) fn read(self, table: &CollectionTable, max_errors: usize) -> (Vec<Read>, Vec<ObjectError>) {
        let refused = |error: ObjectError| (Vec::new(), vec![error]);
        if self.kind.as_deref() == Some("List") {
            let Some(items) = self.items else {
                return refused(ObjectError {
                    reason: "a kind: List holds its resources under items".into(),
                    path: vec![key("kind")],
                });
            };
            if self.spec.is_some() || self.metadata.as_ref().is_some_and(|m| m.name.is_some()) {
                return refused(ObjectError {
                    reason: "a kind: List has items, not a spec or a name of its own".into(),
                    path: vec![key(if self.spec.is_some() { "spec" } else { "metadata" })],
                });
            }
            let (mut read, mut errors) = (Vec::new(), Vec::new());
            for (index, item) in items.into_iter().enumerate() {
                if errors.len() >= max_errors {
                    break;
                }
                let at = vec![key("items"), PathStep::Index(index)];
                let object = Object {
                    api_version: item.api_version,
                    kind: item.kind,
                    metadata: item.metadata,
                    spec: item.spec,
                    items: item.items,
                };
                if object.kind.as_deref() == Some("List") || object.items.is_some() {
                    errors.push(ObjectError {
                        reason: "a List inside a List: give the items of one List".into(),
                        path: [at.clone(), vec![key("kind")]].concat(),
                    });
                    continue;
                }
                match object.read_one(table, at, max_errors - errors.len()) {
                    Ok(one) => read.push(one),
                    Err(refused) => errors.extend(refused),
                }
            }
            errors.truncate(max_errors);
            return (read, errors);
        }
        if self.items.is_some() {
            return refused(ObjectError {
                reason: "items belongs to a kind: List".into(),
                path: vec![key("items")],
            });
        }
        match self.read_one(table, Vec::new(), max_errors) {
            Ok(one) => (vec![one], Vec::new()),
            Err(errors) => (Vec::new(), errors),
        }
    }

    fn read_one(self, table: &CollectionTable, at: Vec<PathStep>, max_errors: usize) -> Result<Read, Vec<ObjectError>> {
        let fail = |reason: String, steps: &[&str]| {
            vec![ObjectError {
                reason,
                path: [at.clone(), steps.iter().map(|s| key(s)).collect()].concat(),
            }]
        };
        let api_version = given(&self.api_version)
            .ok_or_else(|| fail("apiVersion is missing (networking.istio.io/v1, ...)".into(), &["kind"]))?;
        let kind =
            given(&self.kind).ok_or_else(|| fail("kind is missing (VirtualService, ...)".into(), &["apiVersion"]))?;
        let info = table
            .kind(api_version, kind)
            .ok_or_else(|| fail(unknown_kind(table, api_version, kind), &["kind"]))?;
        let metadata = self.metadata.unwrap_or_default();
        let name = given(&metadata.name).ok_or_else(|| {
            fail(
                "metadata.name is missing; every resource needs a name".into(),
                &["metadata"],
            )
        })?;
        let namespace = given(&metadata.namespace);
        for (field, value) in [("name", Some(name)), ("namespace", namespace)] {
            if let Some(value) = value.filter(|v| v.contains('/')) {
                return Err(fail(
                    format!("metadata.{field} {value:?} has a '/': Kubernetes names have none"),
                    &["metadata", field],
                ));
            }
        }
        let name = resource_name(info.cluster_scoped, name, namespace);
        let collection = info.collection.clone();
        let type_url = table
            .get(&collection)
            .map(|c| c.body_type_url.clone())
            .unwrap_or_default();
        let descriptor = proto_json::message_type(&type_url)
            .filter(|_| type_url != STRUCT_TYPE_URL)
            .ok_or_else(|| fail(no_proto(kind, &collection, &type_url), &["kind"]))?;
        // No spec, or `spec:` with nothing after it: every field at its default.
        let spec = match self.spec {
            Some(YamlValue(spec)) if !spec.is_null() => spec,
            _ => serde_json::Value::Object(Default::default()),
        };
        let value = proto_json::encode_message_all(&descriptor, spec, max_errors).map_err(|errors| {
            errors
                .into_iter()
                .map(|e| {
                    let path = [vec![key("spec")], e.path].concat();
                    ObjectError {
                        reason: format!("{}: {}", proto_json::display_path(&path), e.message),
                        path: [at.clone(), path].concat(),
                    }
                })
                .collect::<Vec<_>>()
        })?;
        let strings = |map: BTreeMap<YamlString, YamlString>| map.into_iter().map(|(k, v)| (k.0, v.0)).collect();
        Ok(Read {
            collection,
            name,
            labels: strings(metadata.labels),
            annotations: strings(metadata.annotations),
            body: prost_types::Any { type_url, value },
            at,
        })
    }
}

/// The name Galley gave a resource: `namespace/name` (the namespace
/// `default` when none is given, as `kubectl apply`), and a cluster-scoped
/// one (MeshPolicy, ClusterRbacConfig) by its name alone.
pub(super) fn resource_name(cluster_scoped: bool, name: &str, namespace: Option<&str>) -> String {
    if cluster_scoped {
        name.to_owned()
    } else {
        format!(
            "{}/{name}",
            namespace
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .unwrap_or(DEFAULT_NAMESPACE)
        )
    }
}

/// A string field that is there and not blank, trimmed.
fn given(field: &Option<String>) -> Option<&str> {
    field.as_deref().map(str::trim).filter(|value| !value.is_empty())
}

fn key(name: &str) -> PathStep {
    PathStep::Key(name.to_owned())
}

fn unknown_kind(table: &CollectionTable, api_version: &str, kind: &str) -> String {
    let kinds = table.kinds_of(api_version);
    if kinds.is_empty() {
        format!(
            "apiVersion {api_version:?} is not one this gateway reads (groups {}); write other resources in the \
             gateway's own form (collection, name, body)",
            table.api_groups().join(", ")
        )
    } else {
        let meant = proto_json::closest(kind, kinds.iter().copied())
            .map(|near| format!("did you mean {near}? "))
            .unwrap_or_default();
        format!(
            "kind {kind:?} is not a kind of {api_version} this gateway reads ({meant}it reads {})",
            kinds.join(", ")
        )
    }
}

fn no_proto(kind: &str, collection: &str, type_url: &str) -> String {
    let why = if type_url == STRUCT_TYPE_URL {
        "is a Mixer kind: its params depend on the adapter (a google.protobuf.Struct), so no proto reads its spec"
    } else {
        "has no proto in this gateway to read its spec with"
    };
    format!(
        "kind {kind} ({collection}) {why}; write it in the gateway's own form: collection: {collection}, \
         name: namespace/name, body: {{type_url: {type_url}, value_base64: <the encoded body>}}"
    )
}
