//! What Envoy's clusters need of another type: an EDS cluster that Envoy
//! (re)creates waits, warming, for its load assignment, and if that is not
//! sent it waits forever (envoy#22418: a server that skipped the load
//! assignment of a cluster it resent left the cluster warming, 503 `UH`).
//! So a response of clusters forces the load assignments of the EDS clusters
//! in it out again on the same stream, right after; istiod does the same
//! (EDS pushed after CDS). Read from the body bytes (`Cluster.name` 1,
//! `type` 2, `eds_cluster_config` 3 with `service_name` 2), once per
//! resource.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::Buf;
use prost::encoding::{decode_key, decode_varint, WireType};
use prost::Message;

use super::type_state::Push;
use crate::cache::memo::MemoKey;
use crate::cache::{CachedResource, CollectionSnapshot, Diff};
use crate::SharedStr;

pub const CLUSTER_TYPE_URL: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ROUTE_CONFIGURATION_TYPE_URL: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub const LOAD_ASSIGNMENT_TYPE_URL: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// `Cluster.DiscoveryType.EDS`.
const EDS: u64 = 3;

/// The load assignments (their names, as EDS asks for them) of the EDS
/// clusters that `push`, a response on `type_url`, sends to a client last
/// sent `previous`: empty unless `type_url` is the Cluster type. A
/// state-of-the-world response carries every cluster, but Envoy re-creates
/// only those whose content changed: with `previous`, only those count.
pub fn load_assignments_forced_by(
    type_url: &str,
    push: &Push,
    previous: Option<&Arc<CollectionSnapshot>>,
) -> Vec<SharedStr> {
    if type_url != CLUSTER_TYPE_URL {
        return Vec::new();
    }
    match push {
        Push::Full { to } | Push::FirstFromReported { to, .. } => match previous {
            Some(from) if matches!(push, Push::Full { .. }) => changed(from, to),
            _ => {
                let all = to
                    .memo
                    .get_or_make(MemoKey::of("cluster_refs.all"), 1, || names(&mut to.resources.values()));
                all.to_vec()
            }
        },
        Push::Diff { from, to } => changed(from, to),
        Push::Selected { diff, .. } => names(&mut diff.upserts.iter()),
    }
}

/// The load assignments of the EDS clusters new or changed from `from` to
/// `to`: found once per pair (every client at `from` asks) and kept with
/// `to`.
fn changed(from: &CollectionSnapshot, to: &CollectionSnapshot) -> Vec<SharedStr> {
    let key = MemoKey::with("cluster_refs.changed", from.version.clone());
    let made = to.memo.get_or_make(key, CHANGES_PER_SNAPSHOT, || {
        names(&mut Diff::between(&from.resources, &to.resources).upserts.iter())
    });
    made.to_vec()
}

/// Distinct from-versions whose forced names a snapshot keeps.
const CHANGES_PER_SNAPSHOT: usize = 32;

/// The load assignments of the EDS clusters among `clusters`, sorted, once
/// each.
fn names(clusters: &mut dyn Iterator<Item = &Arc<CachedResource>>) -> Vec<SharedStr> {
    let names: BTreeSet<SharedStr> = clusters.filter_map(|r| eds_name(r)).collect();
    names.into_iter().collect()
}

/// The load assignment an EDS cluster asks for: its
/// `eds_cluster_config.service_name`, or its name when that is empty.
/// `None` for any other cluster, or a body that does not read as one.
pub fn eds_name(cluster: &CachedResource) -> Option<SharedStr> {
    let made = cluster
        .memo
        .get_or_make(MemoKey::of("cluster_refs.eds_name"), 1, || read_eds_name(cluster));
    Option::clone(&made)
}

fn read_eds_name(cluster: &CachedResource) -> Option<SharedStr> {
    let body = body_of(cluster)?;
    let (mut name, mut kind, mut service) = (None, 0, None);
    for_each_field(&body, |tag, field| {
        match (tag, field) {
            (1, Field::Bytes(bytes)) => name = Some(bytes),
            (2, Field::Varint(value)) => kind = value,
            (3, Field::Bytes(config)) => {
                for_each_field(config, |tag, field| {
                    if let (2, Field::Bytes(bytes)) = (tag, field) {
                        service = Some(bytes);
                    }
                    Some(())
                })?;
            }
            _ => {}
        }
        Some(())
    })?;
    if kind != EDS {
        return None;
    }
    let chosen = service.filter(|s| !s.is_empty()).or(name)?;
    std::str::from_utf8(chosen).ok().map(SharedStr::from)
}

/// The clusters a route configuration's routes send to (a route action's
/// `cluster`, and the names of its `weighted_clusters`), read from its body
/// once and kept with the resource.
pub fn route_clusters(route: &CachedResource) -> Arc<[SharedStr]> {
    let made = route
        .memo
        .get_or_make(MemoKey::of("cluster_refs.route_clusters"), 1, || {
            read_route_clusters(route)
        });
    Arc::clone(&made)
}

fn read_route_clusters(route: &CachedResource) -> Arc<[SharedStr]> {
    let mut clusters = Names::default();
    if let Some(body) = body_of(route) {
        let _ = route_config_clusters(&body, &mut clusters);
    }
    clusters.done()
}

/// The body of a cached resource (its `Any`'s value), as stored.
fn body_of(resource: &CachedResource) -> Option<bytes::Bytes> {
    let resource = crate::proto::wire::RawResource::decode(resource.encoded.clone()).ok()?;
    Some(prost_types::Any::decode(resource.body?).ok()?.value.into())
}

/// Names read from bodies, sorted and once each when done.
#[derive(Default)]
struct Names(Vec<SharedStr>);

impl Names {
    fn add(&mut self, bytes: &[u8]) {
        if let Ok(text) = std::str::from_utf8(bytes) {
            self.0.push(SharedStr::from(text));
        }
    }

    fn done(mut self) -> Arc<[SharedStr]> {
        self.0.sort();
        self.0.dedup();
        self.0.into()
    }
}

/// The clusters a `RouteConfiguration`'s routes send to: virtual_hosts (2)
/// . routes (3) . route (2: RouteAction) . cluster (1) | weighted_clusters
/// (3) . clusters (1) . name (1).
fn route_config_clusters(config: &[u8], clusters: &mut Names) -> Option<()> {
    for_each_field(config, |tag, field| {
        let (2, Field::Bytes(host)) = (tag, field) else {
            return Some(());
        };
        for_each_field(host, |tag, field| {
            let (3, Field::Bytes(entry)) = (tag, field) else {
                return Some(());
            };
            for_each_field(entry, |tag, field| {
                let (2, Field::Bytes(action)) = (tag, field) else {
                    return Some(());
                };
                for_each_field(action, |tag, field| {
                    match (tag, field) {
                        (1, Field::Bytes(cluster)) => clusters.add(cluster),
                        (3, Field::Bytes(weighted)) => weighted_names(weighted, clusters)?,
                        _ => {}
                    }
                    Some(())
                })
            })
        })
    })
}

/// The names of a weighted cluster list (route's `WeightedCluster` and tcp
/// proxy's alike: clusters (1) . name (1)).
fn weighted_names(weighted: &[u8], clusters: &mut Names) -> Option<()> {
    for_each_field(weighted, |tag, field| {
        let (1, Field::Bytes(weight)) = (tag, field) else {
            return Some(());
        };
        for_each_field(weight, |tag, field| {
            if let (1, Field::Bytes(cluster)) = (tag, field) {
                clusters.add(cluster);
            }
            Some(())
        })
    })
}

/// What a listener's filters name of the types before it: the clusters its
/// TCP proxies and inline route configurations send to, and the route
/// configurations its HTTP connection managers read by RDS.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ListenerRefs {
    pub clusters: Arc<[SharedStr]>,
    pub routes: Arc<[SharedStr]>,
}

const HCM_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const TCP_PROXY_TYPE_URL: &str = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";

/// A listener's [`ListenerRefs`], read from its body once and kept with the
/// resource. Read: `filter_chains` (3) and `default_filter_chain` (25), each
/// chain's `filters` (3) with their `typed_config` (4, an `Any`); of an
/// `HttpConnectionManager`, `rds` (3) . `route_config_name` (2) and the
/// inline `route_config` (4); of a `TcpProxy`, `cluster` (2) and
/// `weighted_clusters` (10). Not read: scoped routes, an API listener (a
/// client's, never drained), other filters.
pub fn listener_refs(listener: &CachedResource) -> Arc<ListenerRefs> {
    listener
        .memo
        .get_or_make(MemoKey::of("cluster_refs.listener_refs"), 1, || {
            read_listener_refs(listener)
        })
}

fn read_listener_refs(listener: &CachedResource) -> ListenerRefs {
    let (mut clusters, mut routes) = (Names::default(), Names::default());
    if let Some(body) = body_of(listener) {
        let _ = for_each_field(&body, |tag, field| {
            let (3 | 25, Field::Bytes(chain)) = (tag, field) else {
                return Some(());
            };
            for_each_field(chain, |tag, field| {
                let (3, Field::Bytes(filter)) = (tag, field) else {
                    return Some(());
                };
                for_each_field(filter, |tag, field| {
                    let (4, Field::Bytes(any)) = (tag, field) else {
                        return Some(());
                    };
                    let any = prost_types::Any::decode(any).ok()?;
                    match any.type_url.as_str() {
                        HCM_TYPE_URL => for_each_field(&any.value, |tag, field| {
                            match (tag, field) {
                                (3, Field::Bytes(rds)) => for_each_field(rds, |tag, field| {
                                    if let (2, Field::Bytes(name)) = (tag, field) {
                                        routes.add(name);
                                    }
                                    Some(())
                                })?,
                                (4, Field::Bytes(config)) => route_config_clusters(config, &mut clusters)?,
                                _ => {}
                            }
                            Some(())
                        }),
                        TCP_PROXY_TYPE_URL => for_each_field(&any.value, |tag, field| {
                            match (tag, field) {
                                (2, Field::Bytes(cluster)) => clusters.add(cluster),
                                (10, Field::Bytes(weighted)) => weighted_names(weighted, &mut clusters)?,
                                _ => {}
                            }
                            Some(())
                        }),
                        _ => Some(()),
                    }
                })
            })
        });
    }
    ListenerRefs {
        clusters: clusters.done(),
        routes: routes.done(),
    }
}

/// A field's value, as far as this module reads it.
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Other,
}

/// Calls `read` with each field of `message` (the last of a repeated
/// scalar wins, as protobuf reads it); `None` when the bytes are not a
/// message or `read` says so.
fn for_each_field<'a>(message: &'a [u8], mut read: impl FnMut(u32, Field<'a>) -> Option<()>) -> Option<()> {
    let mut rest = message;
    while rest.has_remaining() {
        let (tag, wire_type) = decode_key(&mut rest).ok()?;
        let field = match wire_type {
            WireType::Varint => Field::Varint(decode_varint(&mut rest).ok()?),
            WireType::LengthDelimited => {
                let len = usize::try_from(decode_varint(&mut rest).ok()?).ok()?;
                let (bytes, tail) = rest.split_at_checked(len)?;
                rest = tail;
                Field::Bytes(bytes)
            }
            WireType::SixtyFourBit => {
                rest = rest.get(8..)?;
                Field::Other
            }
            WireType::ThirtyTwoBit => {
                rest = rest.get(4..)?;
                Field::Other
            }
            WireType::StartGroup | WireType::EndGroup => return None,
        };
        read(tag, field)?;
    }
    Some(())
}

/// Names forced on a type the stream does not follow yet (Envoy asks for
/// load assignments after the clusters that name them), and the types owed
/// a send since a force.
#[derive(Debug, Default)]
pub struct ForcedResends {
    pending: BTreeMap<String, BTreeSet<SharedStr>>,
    owed: Vec<String>,
}

impl ForcedResends {
    /// `names` forced on `type_url`, which the stream does not follow.
    pub fn pend(&mut self, type_url: &str, names: Vec<SharedStr>) {
        self.pending.entry(type_url.to_owned()).or_default().extend(names);
    }

    /// What was forced on `type_url` before the stream followed it.
    pub fn take_pending(&mut self, type_url: &str) -> Option<BTreeSet<SharedStr>> {
        self.pending.remove(type_url)
    }

    /// `type_url` is owed a send.
    pub fn owe(&mut self, type_url: &str) {
        if !self.owed.iter().any(|t| t == type_url) {
            self.owed.push(type_url.to_owned());
        }
    }

    pub fn is_owed(&self) -> bool {
        !self.owed.is_empty()
    }

    pub fn take_owed(&mut self) -> Vec<String> {
        std::mem::take(&mut self.owed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Cache, Origin, Update};

    /// A cluster's body: name, type, and an `eds_cluster_config` with a
    /// `service_name` (none when empty), encoded by hand as Envoy's protos
    /// lay it out.
    pub(crate) fn cluster(name: &str, kind: u64, service: Option<&str>) -> CachedResource {
        let mut value = Vec::new();
        prost::encoding::string::encode(1, &name.to_owned(), &mut value);
        prost::encoding::uint64::encode(2, &kind, &mut value);
        if let Some(service) = service {
            let mut config = Vec::new();
            // eds_config (1): an empty ConfigSource, then service_name (2).
            prost::encoding::bytes::encode(1, &Vec::<u8>::new(), &mut config);
            prost::encoding::string::encode(2, &service.to_owned(), &mut config);
            prost::encoding::bytes::encode(3, &config, &mut value);
        }
        // Wrapped in an `Any` (of another type name: not read).
        let encoded = crate::proto::wire::test_support::encoded_resource(name, "1", &value);
        let none = std::collections::HashMap::<String, String>::new();
        let digest = crate::cache::content_digest(&value, &none, &none);
        CachedResource::new(name.into(), encoded, digest)
    }

    #[test]
    fn an_eds_cluster_names_its_load_assignment() {
        assert_eq!(eds_name(&cluster("a", EDS, Some("svc-a"))).as_deref(), Some("svc-a"));
        assert_eq!(
            eds_name(&cluster("b", EDS, Some(""))).as_deref(),
            Some("b"),
            "empty: the name"
        );
        assert_eq!(eds_name(&cluster("c", EDS, None)).as_deref(), Some("c"));
        assert_eq!(eds_name(&cluster("d", 1, None)), None, "STRICT_DNS: no EDS");
    }

    #[test]
    fn a_cluster_push_forces_the_load_assignments_of_its_eds_clusters() {
        let (cache, mut writer) = Cache::new();
        let c = "envoy/config/cluster/v3/clusters";
        writer.apply(
            c,
            Update::Full(vec![cluster("a", EDS, Some("svc-a")), cluster("b", 0, None)]),
            Origin::Upstream,
        );
        let v1 = cache.get(c).unwrap();
        writer.apply(
            c,
            Update::Full(vec![
                cluster("a", EDS, Some("svc-a")),
                cluster("b", 0, None),
                cluster("e", EDS, None),
            ]),
            Origin::Upstream,
        );
        let v2 = cache.get(c).unwrap();
        let full = Push::Full { to: v2.clone() };
        let forced = |push: &Push, previous| load_assignments_forced_by(CLUSTER_TYPE_URL, push, previous);
        assert_eq!(
            forced(&full, None),
            [SharedStr::from("e"), SharedStr::from("svc-a")],
            "all, first"
        );
        assert_eq!(forced(&full, Some(&v1)), [SharedStr::from("e")], "those that changed");
        let diff = Push::Diff {
            from: v1.clone(),
            to: v2.clone(),
        };
        assert_eq!(forced(&diff, None), [SharedStr::from("e")]);
        assert!(load_assignments_forced_by(LOAD_ASSIGNMENT_TYPE_URL, &full, None).is_empty());
    }
}
