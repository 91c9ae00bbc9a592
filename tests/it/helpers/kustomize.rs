//! A renderer for the part of kustomize the manifests in `deploy/` use, so
//! the `deploy::` checks run on every machine, kubectl or not: `resources`
//! (files and directories), `components`, `namespace`, `labels` (with
//! `includeSelectors`), `images`, `patches` (strategic merge, `$patch:
//! delete` included, and inline JSON 6902 with a kind and name target) and
//! `configMapGenerator` (files and literals, without the name hash). Any
//! other field or option is an error naming it, so a manifest cannot outgrow
//! the renderer unnoticed; `deploy::the_renderer_agrees_with_kustomize`
//! compares it with `kubectl kustomize` wherever kubectl is installed.
//!
//! kustomize's order: a kustomization's resources (each directory built
//! whole, its own transformers applied), then its components, then its
//! generators, then its patches, namespace, labels and images, in that order.

use std::path::Path;

use serde_norway::{Mapping, Value};

/// Renders the kustomization in `dir`, as `kubectl kustomize DIR` would
/// (in another order: kustomize sorts by kind).
pub fn render(dir: &Path) -> Result<Vec<Value>, String> {
    build(dir)
}

/// Kinds that live outside namespaces (the namespace transformer skips
/// them, and they need none).
const CLUSTER_SCOPED: &[&str] = &[
    "APIService",
    "ClusterRole",
    "ClusterRoleBinding",
    "CSIDriver",
    "CustomResourceDefinition",
    "IngressClass",
    "MutatingWebhookConfiguration",
    "Namespace",
    "Node",
    "PersistentVolume",
    "PriorityClass",
    "RuntimeClass",
    "StorageClass",
    "ValidatingWebhookConfiguration",
];

pub fn is_namespaced(kind: &str) -> bool {
    !CLUSTER_SCOPED.contains(&kind)
}

fn kind(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or("")
}

fn name(doc: &Value) -> &str {
    doc["metadata"]["name"].as_str().unwrap_or("")
}

/// Every document of a YAML file (empty ones left out).
fn read_docs(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_docs(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn parse_docs(text: &str) -> Result<Vec<Value>, String> {
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let value: Value = serde::Deserialize::deserialize(doc).map_err(|e| e.to_string())?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// The kustomization of `dir`, its fields checked against what this
/// renderer implements.
fn kustomization(dir: &Path) -> Result<Value, String> {
    let file = ["kustomization.yaml", "kustomization.yml", "Kustomization"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{}: no kustomization file", dir.display()))?;
    let mut docs = read_docs(&file)?;
    let doc = docs.pop().ok_or_else(|| format!("{}: empty", file.display()))?;
    const KNOWN: &[&str] = &[
        "apiVersion",
        "kind",
        "resources",
        "components",
        "namespace",
        "labels",
        "images",
        "patches",
        "configMapGenerator",
    ];
    for key in doc.as_mapping().into_iter().flat_map(Mapping::keys) {
        let key = key.as_str().unwrap_or("");
        if !KNOWN.contains(&key) {
            return Err(format!(
                "{}: `{key}` is not implemented by the test's kustomize renderer (tests/it/helpers/kustomize.rs)",
                file.display()
            ));
        }
    }
    Ok(doc)
}

fn list<'a>(doc: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    doc[key].as_sequence().into_iter().flatten()
}

fn string<'a>(value: &'a Value, what: &str) -> Result<&'a str, String> {
    value.as_str().ok_or_else(|| format!("{what}: not a string: {value:?}"))
}

/// A field whose keys must be among `known`.
fn only(value: &Value, known: &[&str], what: &str) -> Result<(), String> {
    for key in value.as_mapping().into_iter().flat_map(Mapping::keys) {
        let key = key.as_str().unwrap_or("");
        if !known.contains(&key) {
            return Err(format!(
                "{what}: `{key}` is not implemented by the test's kustomize renderer"
            ));
        }
    }
    Ok(())
}

fn build(dir: &Path) -> Result<Vec<Value>, String> {
    let doc = kustomization(dir)?;
    if kind(&doc) == "Component" {
        return Err(format!("{}: a Component is not a resource", dir.display()));
    }
    let mut resources = Vec::new();
    accumulate(dir, &doc, &mut resources)?;
    Ok(resources)
}

/// A component adds its resources to what the including kustomization has
/// so far, and its transformers apply to all of it.
fn component(dir: &Path, resources: &mut Vec<Value>) -> Result<(), String> {
    let doc = kustomization(dir)?;
    if kind(&doc) != "Component" {
        return Err(format!("{}: not a Component", dir.display()));
    }
    accumulate(dir, &doc, resources)
}

/// Adds `doc`'s resources and components to `resources`, then applies its
/// generators and transformers to all of them.
fn accumulate(dir: &Path, doc: &Value, resources: &mut Vec<Value>) -> Result<(), String> {
    for entry in list(doc, "resources") {
        let path = dir.join(string(entry, "resources")?);
        if path.is_dir() {
            resources.extend(build(&path)?);
        } else {
            resources.extend(read_docs(&path)?);
        }
    }
    for entry in list(doc, "components") {
        component(&dir.join(string(entry, "components")?), resources)?;
    }
    transform(dir, doc, resources)
}

fn transform(dir: &Path, doc: &Value, resources: &mut Vec<Value>) -> Result<(), String> {
    for generator in list(doc, "configMapGenerator") {
        resources.push(config_map(dir, generator)?);
    }
    for patch in list(doc, "patches") {
        apply_patch(dir, patch, resources)?;
    }
    if let Some(namespace) = doc.get("namespace") {
        let namespace = string(namespace, "namespace")?;
        for resource in resources.iter_mut().filter(|r| is_namespaced(kind(r))) {
            at(resource, &["metadata"], true, &mut |metadata| {
                metadata["namespace"] = Value::from(namespace);
            });
        }
    }
    for labels in list(doc, "labels") {
        add_labels(labels, resources)?;
    }
    for image in list(doc, "images") {
        set_image(image, resources)?;
    }
    Ok(())
}

// === generators ===

fn config_map(dir: &Path, generator: &Value) -> Result<Value, String> {
    only(
        generator,
        &["name", "namespace", "files", "literals", "options", "behavior"],
        "configMapGenerator",
    )?;
    if generator["behavior"].as_str().is_some_and(|b| b != "create") {
        return Err("configMapGenerator: only behavior `create` is implemented".into());
    }
    let options = &generator["options"];
    only(
        options,
        &["disableNameSuffixHash", "labels", "annotations"],
        "configMapGenerator options",
    )?;
    if options["disableNameSuffixHash"] != true {
        return Err("configMapGenerator: the name hash is not implemented; set disableNameSuffixHash".into());
    }
    let mut data = Mapping::new();
    for file in list(generator, "files") {
        let file = string(file, "configMapGenerator files")?;
        let (key, path) = match file.split_once('=') {
            Some((key, path)) => (key.to_owned(), path),
            None => (
                Path::new(file).file_name().unwrap().to_string_lossy().into_owned(),
                file,
            ),
        };
        let text = std::fs::read_to_string(dir.join(path)).map_err(|e| format!("{file}: {e}"))?;
        data.insert(Value::from(key), Value::from(text));
    }
    for literal in list(generator, "literals") {
        let literal = string(literal, "configMapGenerator literals")?;
        let (key, value) = literal
            .split_once('=')
            .ok_or_else(|| format!("{literal:?} is not KEY=VALUE"))?;
        data.insert(Value::from(key), Value::from(value));
    }
    let mut metadata = Mapping::new();
    metadata.insert("name".into(), generator["name"].clone());
    for (key, field) in [
        ("namespace", &generator["namespace"]),
        ("labels", &options["labels"]),
        ("annotations", &options["annotations"]),
    ] {
        if !field.is_null() {
            metadata.insert(key.into(), field.clone());
        }
    }
    let mut map = Mapping::new();
    map.insert("apiVersion".into(), "v1".into());
    map.insert("kind".into(), "ConfigMap".into());
    map.insert("metadata".into(), Value::Mapping(metadata));
    map.insert("data".into(), Value::Mapping(data));
    Ok(Value::Mapping(map))
}

// === patches ===

fn apply_patch(dir: &Path, entry: &Value, resources: &mut Vec<Value>) -> Result<(), String> {
    only(entry, &["path", "patch", "target"], "patches")?;
    let text = match (&entry["path"], &entry["patch"]) {
        (Value::String(path), Value::Null) => {
            std::fs::read_to_string(dir.join(path)).map_err(|e| format!("patch {path}: {e}"))?
        }
        (Value::Null, Value::String(inline)) => inline.clone(),
        _ => return Err(format!("patches: give one of path and patch: {entry:?}")),
    };
    let target = &entry["target"];
    only(target, &["kind", "name"], "patch target")?;
    let targeted = |resource: &Value| {
        target["kind"].as_str().is_none_or(|k| k == kind(resource))
            && target["name"].as_str().is_none_or(|n| n == name(resource))
    };
    let docs = parse_docs(&text)?;
    if let [Value::Sequence(operations)] = &docs[..] {
        if target.is_null() {
            return Err("a JSON 6902 patch needs a target".into());
        }
        let mut matched = false;
        for resource in resources.iter_mut().filter(|r| targeted(r)) {
            matched = true;
            for operation in operations {
                json_patch(resource, operation)?;
            }
        }
        return matched
            .then_some(())
            .ok_or_else(|| format!("no resource matches {target:?}"));
    }
    for patch in &docs {
        let mut matched = false;
        let delete = patch["$patch"] == "delete";
        let mut index = 0;
        while index < resources.len() {
            let resource = &mut resources[index];
            let hit = targeted(resource) && kind(patch) == kind(resource) && name(patch) == name(resource);
            if hit && delete {
                resources.remove(index);
                matched = true;
                continue;
            }
            if hit {
                let resource_kind = kind(resource).to_owned();
                merge(resource, patch, &resource_kind, &mut Vec::new())?;
                matched = true;
            }
            index += 1;
        }
        if !matched {
            return Err(format!(
                "no resource matches the patch of {} {}",
                kind(patch),
                name(patch)
            ));
        }
    }
    Ok(())
}

/// The strategic merge key of the list at `path` in a `kind`, where
/// Kubernetes has one; other lists are replaced whole.
fn merge_key(kind: &str, path: &[String]) -> Option<&'static str> {
    let field = path.last()?.as_str();
    let in_container = path
        .iter()
        .any(|p| matches!(p.as_str(), "containers" | "initContainers"));
    match field {
        "containers" | "initContainers" | "ephemeralContainers" | "volumes" | "env" | "imagePullSecrets" => {
            Some("name")
        }
        "volumeMounts" => Some("mountPath"),
        "ports" if in_container => Some("containerPort"),
        "ports" if kind == "Service" => Some("port"),
        _ => None,
    }
}

/// A value as a patch inserts it: directives and nulls (deletions of what
/// is not there) left out.
fn clean(value: &Value) -> Value {
    match value {
        Value::Mapping(map) => Value::Mapping(
            map.iter()
                .filter(|(k, v)| !v.is_null() && !k.as_str().is_some_and(|k| k.starts_with('$')))
                .map(|(k, v)| (k.clone(), clean(v)))
                .collect(),
        ),
        Value::Sequence(items) => Value::Sequence(items.iter().map(clean).collect()),
        other => other.clone(),
    }
}

/// Strategic merge of `patch` into `target`: maps merge, `null` deletes,
/// lists with a merge key merge by it (the patch's elements first, in its
/// order, then the target's others), other lists and scalars are replaced.
fn merge(target: &mut Value, patch: &Value, kind: &str, path: &mut Vec<String>) -> Result<(), String> {
    let (Value::Mapping(into), Value::Mapping(from)) = (&mut *target, patch) else {
        *target = clean(patch);
        return Ok(());
    };
    for (key, value) in from {
        let field = key.as_str().unwrap_or("").to_owned();
        if field.starts_with('$') {
            if path.is_empty() && field == "$patch" {
                continue;
            }
            return Err(format!(
                "the directive {field} is not implemented by the test's kustomize renderer"
            ));
        }
        if value.is_null() {
            into.remove(key);
            continue;
        }
        path.push(field);
        match (into.get_mut(key), value) {
            (Some(existing @ Value::Mapping(_)), Value::Mapping(_)) => merge(existing, value, kind, path)?,
            (Some(Value::Sequence(existing)), Value::Sequence(elements)) => match merge_key(kind, path) {
                Some(merge_key) => {
                    let merged = merge_list(existing, elements, merge_key, kind, path)?;
                    *existing = merged;
                }
                None => *existing = elements.iter().map(clean).collect(),
            },
            (_, value) => {
                into.insert(key.clone(), clean(value));
            }
        }
        path.pop();
    }
    Ok(())
}

fn merge_list(
    existing: &[Value],
    elements: &[Value],
    merge_key: &str,
    kind: &str,
    path: &mut Vec<String>,
) -> Result<Vec<Value>, String> {
    let mut used = vec![false; existing.len()];
    let mut merged = Vec::new();
    for element in elements {
        let key = &element[merge_key];
        let found = (0..existing.len()).find(|&i| !used[i] && existing[i][merge_key] == *key);
        if let Some(i) = found {
            used[i] = true;
        }
        if element["$patch"] == "delete" {
            continue;
        }
        match found {
            Some(i) => {
                let mut value = existing[i].clone();
                merge(&mut value, element, kind, path)?;
                merged.push(value);
            }
            None => merged.push(clean(element)),
        }
    }
    merged.extend(
        existing
            .iter()
            .zip(&used)
            .filter(|(_, used)| !**used)
            .map(|(v, _)| v.clone()),
    );
    Ok(merged)
}

/// One JSON 6902 operation: add, replace or remove.
fn json_patch(doc: &mut Value, operation: &Value) -> Result<(), String> {
    only(operation, &["op", "path", "value"], "JSON 6902 operation")?;
    let op = string(&operation["op"], "op")?;
    let pointer = string(&operation["path"], "path")?;
    let tokens: Vec<String> = pointer
        .strip_prefix('/')
        .ok_or_else(|| format!("{pointer}: not a JSON pointer"))?
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let (last, parents) = tokens.split_last().expect("split gives one token at least");
    let mut parent = &mut *doc;
    for token in parents {
        parent = match parent {
            Value::Mapping(map) => map.get_mut(token.as_str()),
            Value::Sequence(items) => token.parse::<usize>().ok().and_then(|i| items.get_mut(i)),
            _ => None,
        }
        .ok_or_else(|| format!("{pointer}: {token} is not there"))?;
    }
    let value = || operation["value"].clone();
    match (op, parent) {
        ("add" | "replace", Value::Mapping(map)) => {
            if op == "replace" && !map.contains_key(last.as_str()) {
                return Err(format!("{pointer}: nothing to replace"));
            }
            map.insert(Value::from(last.as_str()), value());
        }
        ("remove", Value::Mapping(map)) => {
            map.remove(last.as_str())
                .ok_or_else(|| format!("{pointer}: nothing to remove"))?;
        }
        ("add", Value::Sequence(items)) if last == "-" => items.push(value()),
        (op, Value::Sequence(items)) => {
            let index: usize = last.parse().map_err(|_| format!("{pointer}: not an index"))?;
            match op {
                "add" if index <= items.len() => items.insert(index, value()),
                "replace" if index < items.len() => items[index] = value(),
                "remove" if index < items.len() => {
                    items.remove(index);
                }
                _ => return Err(format!("{pointer}: {op} out of range or not implemented")),
            }
        }
        (op, _) => return Err(format!("{pointer}: {op} not implemented or not applicable")),
    }
    Ok(())
}

// === labels and images ===

/// Calls `edit` on the mapping at `path` (`[]` steps into every element of
/// a list): made where missing if `create`, else only where it is there.
fn at(value: &mut Value, path: &[&str], create: bool, edit: &mut dyn FnMut(&mut Value)) {
    let Some((first, rest)) = path.split_first() else {
        if value.is_null() {
            *value = Value::Mapping(Mapping::new());
        }
        edit(value);
        return;
    };
    if *first == "[]" {
        for item in value.as_sequence_mut().into_iter().flatten() {
            at(item, rest, create, edit);
        }
        return;
    }
    let Value::Mapping(map) = value else { return };
    if !map.contains_key(*first) {
        if !create {
            return;
        }
        map.insert(Value::from(*first), Value::Mapping(Mapping::new()));
    }
    at(map.get_mut(*first).expect("inserted"), rest, create, edit);
}

fn add_labels(entry: &Value, resources: &mut [Value]) -> Result<(), String> {
    only(entry, &["pairs", "includeSelectors"], "labels")?;
    let pairs = entry["pairs"].as_mapping().ok_or("labels: no pairs")?.clone();
    let selectors = entry["includeSelectors"] == true;
    for resource in resources.iter_mut() {
        let mut targets: Vec<(&[&str], bool)> = vec![(&["metadata", "labels"], true)];
        if selectors {
            let pod_spec: &[(&[&str], bool)] = &[
                (&["spec", "selector", "matchLabels"], true),
                (&["spec", "template", "metadata", "labels"], true),
                (
                    &[
                        "spec",
                        "template",
                        "spec",
                        "topologySpreadConstraints",
                        "[]",
                        "labelSelector",
                        "matchLabels",
                    ],
                    false,
                ),
            ];
            match kind(resource) {
                "Service" => targets.push((&["spec", "selector"], true)),
                "Deployment" | "ReplicaSet" | "DaemonSet" | "StatefulSet" => {
                    if !resource["spec"]["template"]["spec"]["affinity"].is_null() {
                        return Err("labels with includeSelectors on a pod affinity: not implemented".into());
                    }
                    targets.extend_from_slice(pod_spec);
                }
                "PodDisruptionBudget" => targets.push((&["spec", "selector", "matchLabels"], false)),
                "NetworkPolicy" => targets.extend_from_slice(&[
                    (&["spec", "podSelector", "matchLabels"][..], false),
                    (
                        &["spec", "ingress", "[]", "from", "[]", "podSelector", "matchLabels"],
                        false,
                    ),
                    (
                        &["spec", "egress", "[]", "to", "[]", "podSelector", "matchLabels"],
                        false,
                    ),
                ]),
                "ReplicationController" | "Job" | "CronJob" => {
                    return Err(format!(
                        "labels with includeSelectors on a {}: not implemented",
                        kind(resource)
                    ))
                }
                _ => {}
            }
        }
        for (path, create) in targets {
            at(resource, path, create, &mut |labels| {
                if let Value::Mapping(labels) = labels {
                    for (key, value) in &pairs {
                        labels.insert(key.clone(), value.clone());
                    }
                }
            });
        }
    }
    Ok(())
}

fn set_image(entry: &Value, resources: &mut [Value]) -> Result<(), String> {
    only(entry, &["name", "newName", "newTag", "digest"], "images")?;
    let wanted = string(&entry["name"], "images name")?;
    for resource in resources.iter_mut() {
        for path in [
            &["spec", "template", "spec", "containers"][..],
            &["spec", "template", "spec", "initContainers"],
            &["spec", "containers"],
            &["spec", "initContainers"],
        ] {
            at(resource, &[path, &["[]"]].concat(), false, &mut |container| {
                let Some(image) = container["image"].as_str() else {
                    return;
                };
                // name[:tag][@digest]; a registry's port is before the last '/'.
                let (rest, digest) = image.split_once('@').map_or((image, None), |(r, d)| (r, Some(d)));
                let slash = rest.rfind('/').map_or(0, |i| i + 1);
                let (name, tag) = match rest[slash..].find(':') {
                    Some(i) => (&rest[..slash + i], Some(&rest[slash + i + 1..])),
                    None => (rest, None),
                };
                if name != wanted {
                    return;
                }
                let mut new = entry["newName"].as_str().unwrap_or(name).to_owned();
                if let Some(digest) = entry["digest"].as_str() {
                    new = format!("{new}@{digest}");
                } else if let Some(tag) = entry["newTag"].as_str().or(tag) {
                    new = format!("{new}:{tag}");
                    if let Some(digest) = digest.filter(|_| entry["newTag"].is_null()) {
                        new = format!("{new}@{digest}");
                    }
                } else if let Some(digest) = digest {
                    new = format!("{new}@{digest}");
                }
                container["image"] = Value::from(new);
            });
        }
    }
    Ok(())
}
