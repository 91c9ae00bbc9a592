//! The named benchmark scenarios and the shape of a run.

use std::time::Duration;

/// What a run publishes and how many clients read it.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Shape {
    pub collections: usize,
    pub resources: usize,
    pub body_bytes: usize,
    pub changes_per_update: usize,
    #[serde(with = "millis")]
    pub update_interval: Duration,
    pub updates: usize,
    /// The fake Galley sends incremental updates (else full states).
    pub upstream_incremental: bool,
    pub streams: usize,
    pub connections: usize,
    /// Clients ask for changes (else for the state of the world each time).
    pub incremental_clients: bool,
    /// The protocol the clients speak.
    pub protocol: ClientProtocol,
}

/// The protocol of the load's clients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientProtocol {
    /// `AggregatedMeshConfigService`: `StreamAggregatedResources`, or
    /// `IncrementalAggregatedResources` where the scenario's clients ask for
    /// changes.
    #[default]
    Mcp,
    /// Envoy's v3 ADS, state of the world, asking for GVKs (MCP over xDS, as
    /// istiod 1.8+ does).
    XdsSotw,
    /// Envoy's v3 ADS, delta, one GVK per stream.
    XdsDelta,
}

impl ClientProtocol {
    /// Whether the clients ask for GVKs (only collections that have one).
    pub fn is_xds(self) -> bool {
        self != ClientProtocol::Mcp
    }
}

mod millis {
    pub fn serialize<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// 3 collections x 20,000 resources x 1 KiB, 50 SotW clients, 10 changes/s.
    BigConfig,
    /// 2,000 SotW streams over 100 connections, 500 x 512 B, an update every 100 ms.
    FanOut,
    /// 200 incremental streams, 10,000 resources, 1 change every 50 ms.
    Incremental,
    /// 10,000 idle SotW streams, 1 small collection.
    Idle,
    /// Named (EDS) fan-out: 10,000 ClusterLoadAssignments of ~400 B, 2,000
    /// v3 clients over 100 connections each subscribed to 50 of them by
    /// name, 1 % of them changing every 100 ms.
    Eds,
    /// A restart under named clients: 2,000 delta clients of 50 names each
    /// (of 10,000 ClusterLoadAssignments) synced, the gateway stopped
    /// (SIGTERM, or SIGKILL with --kill) and started again with the same
    /// --cache-dir, every client reconnecting with what it holds.
    Reconnect,
    /// An hour (--duration) of churn: 3 Istio collections and EDS of about
    /// 300 resources of 512 B, an update (3 adds, edits or removals) every
    /// 200 ms; 32 clients of every protocol, half of them coming, going
    /// and NACKing; the gateway's RSS, descriptors and tasks sampled; every
    /// client at the source's final state at the end.
    Soak,
    /// Distinct identities: 2,000 Envoy clusters of ~1 KiB (2 MB), a policy
    /// granting each namespace the shared clusters and its own, and 300
    /// clients of distinct identities (mTLS) connecting one after another,
    /// each reading the collection once and staying connected.
    Grants,
}

impl Scenario {
    pub fn shape(self) -> Shape {
        match self {
            Scenario::BigConfig => Shape {
                collections: 3,
                resources: 20_000,
                body_bytes: 1024,
                changes_per_update: 1,
                update_interval: Duration::from_millis(100),
                updates: 50,
                // A full 20 MB state ten times a second would measure the
                // fake Galley; the gateway applies either kind the same way.
                upstream_incremental: true,
                streams: 50,
                connections: 50,
                incremental_clients: false,
                protocol: ClientProtocol::Mcp,
            },
            Scenario::FanOut => Shape {
                collections: 1,
                resources: 500,
                body_bytes: 512,
                changes_per_update: 1,
                update_interval: Duration::from_millis(100),
                updates: 50,
                upstream_incremental: false,
                streams: 2_000,
                connections: 100,
                incremental_clients: false,
                protocol: ClientProtocol::Mcp,
            },
            Scenario::Incremental => Shape {
                collections: 1,
                resources: 10_000,
                body_bytes: 512,
                changes_per_update: 1,
                update_interval: Duration::from_millis(50),
                updates: 100,
                upstream_incremental: true,
                streams: 200,
                connections: 20,
                incremental_clients: true,
                protocol: ClientProtocol::Mcp,
            },
            Scenario::Idle => Shape {
                collections: 1,
                resources: 10,
                body_bytes: 256,
                changes_per_update: 0,
                update_interval: Duration::from_millis(100),
                updates: 0,
                upstream_incremental: false,
                streams: 10_000,
                connections: 100,
                incremental_clients: false,
                protocol: ClientProtocol::Mcp,
            },
            Scenario::Eds => Shape {
                collections: 1,
                resources: 10_000,
                // Each ClusterLoadAssignment's size, about: its endpoints
                // are as many as make it so.
                body_bytes: 400,
                // --change-percent of the resources (NamedShape).
                changes_per_update: 100,
                update_interval: Duration::from_millis(100),
                updates: 50,
                upstream_incremental: true,
                streams: 2_000,
                connections: 100,
                incremental_clients: false,
                protocol: ClientProtocol::XdsSotw,
            },
            Scenario::Soak => Shape {
                // The Istio collections (each client kind reads them, or
                // EDS by name).
                collections: 3,
                resources: 300,
                body_bytes: 512,
                changes_per_update: 3,
                update_interval: Duration::from_millis(200),
                // Published until --duration has passed.
                updates: 0,
                upstream_incremental: true,
                // The clients connected at any one time: the first half
                // resident, the rest churning; a connection each.
                streams: 32,
                connections: 32,
                incremental_clients: false,
                protocol: ClientProtocol::Mcp,
            },
            Scenario::Grants => Shape {
                collections: 1,
                resources: 2_000,
                body_bytes: 1024,
                changes_per_update: 0,
                update_interval: Duration::from_millis(100),
                updates: 0,
                upstream_incremental: false,
                streams: 300,
                connections: 300,
                incremental_clients: false,
                protocol: ClientProtocol::XdsSotw,
            },
            Scenario::Reconnect => Shape {
                // Nothing is published after the clients synced.
                updates: 0,
                changes_per_update: 0,
                incremental_clients: true,
                protocol: ClientProtocol::XdsDelta,
                ..Scenario::Eds.shape()
            },
        }
    }

    /// The goal on a 2-core machine, as the issue states it.
    pub fn goal(self) -> &'static str {
        match self {
            Scenario::BigConfig => "peak RSS <= 1.5 x config bytes + 50 MB; all clients synced within 2 s",
            Scenario::FanOut => "p99 end-to-end <= 200 ms",
            Scenario::Incremental => "p99 <= 20 ms; bytes per client per update <= 2 x one resource",
            Scenario::Idle => "<= 10 KiB gateway RSS per stream",
            Scenario::Eds => {
                "no push without a change for the client; CPU per delivered byte <= 1.5 x wire; p99 <= 100 ms; \
                 <= 8 KiB per idle named client with 50 names"
            }
            Scenario::Reconnect => {
                "every client resynced <= 2 s after the restart; gateway CPU for the resync <= 4 x the wire's"
            }
            Scenario::Grants => "200 distinct grants over a 2 MB collection add at most 60 MB of gateway RSS",
            Scenario::Soak => {
                "RSS at the end within 10 % of RSS at 10 minutes; descriptors and tasks flat; every client at the \
                 source's final state; 0 stream errors the scenario did not cause"
            }
        }
    }
}

/// How the named scenario's clients subscribe and its resources change.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct NamedShape {
    /// Names each client subscribes to, drawn at random (seeded).
    pub names_per_client: usize,
    /// The share of the resources changed at each update, in percent.
    pub change_percent: f64,
    pub seed: u64,
    /// The clients' name sets are disjoint, and only the first half of the
    /// clients' names change: the other half are bystanders.
    pub disjoint: bool,
}

impl Default for NamedShape {
    fn default() -> Self {
        Self {
            names_per_client: 50,
            change_percent: 1.0,
            seed: 1,
            disjoint: false,
        }
    }
}

impl NamedShape {
    /// At `Shape::tiny`'s 20 resources: fewer names, more of them changing
    /// (so that three updates reach some client).
    pub fn tiny(self) -> Self {
        Self {
            names_per_client: self.names_per_client.min(4),
            change_percent: self.change_percent.max(10.0),
            ..self
        }
    }

    /// Resources changed at each update of `resources`: at least one where
    /// any are to change.
    pub fn changes_per_update(&self, resources: usize) -> usize {
        let changes = (resources as f64 * self.change_percent / 100.0).round() as usize;
        if self.change_percent > 0.0 {
            changes.clamp(1, resources)
        } else {
            0
        }
    }
}

impl Shape {
    /// The same shape at a size that runs in seconds (smoke tests).
    pub fn tiny(self) -> Shape {
        Shape {
            resources: self.resources.min(20),
            body_bytes: self.body_bytes.min(64),
            updates: self.updates.min(3),
            update_interval: Duration::from_millis(20),
            streams: self.streams.min(6),
            connections: self.connections.min(3),
            ..self
        }
    }

    /// Bytes of resource content the gateway holds.
    pub fn config_bytes(&self) -> usize {
        self.collections * self.resources * self.body_bytes
    }
}
