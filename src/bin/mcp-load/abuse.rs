//! Attackers that run beside a scenario's clients (`--abuse`): the scenario's
//! clients are the canaries whose latency is reported while the gateway is
//! under attack, and the gateway's RSS shows what the attack costs it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mcp_xds_gateway::proto::{IncrementalMeshConfigRequest, MeshConfigRequest, SinkNode};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use crate::clients::{open, INCREMENTAL_PATH, SOTW_PATH};
use crate::reader::MCP;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Abuse {
    /// 40 streams that NACK every version with a message just under 4 MiB.
    NackFlood,
    /// 40 incremental streams whose first request names ~60,000 resources
    /// (~4 MiB of initial_resource_versions) and that never ACK.
    InitialVersions,
    /// 5,000 connections that finish the HTTP/2 handshake and stay idle.
    IdleConnections,
}

impl Abuse {
    /// How many attackers run (`tiny`: two, for the smoke test).
    pub fn attackers(self, tiny: bool) -> usize {
        match (self, tiny) {
            (_, true) => 2,
            (Abuse::NackFlood | Abuse::InitialVersions, false) => 40,
            (Abuse::IdleConnections, false) => 5_000,
        }
    }
}

/// What the attack did, for the report.
#[derive(Debug, Default)]
pub struct Attack {
    /// Attackers in place (connected, first message sent).
    pub established: AtomicUsize,
    /// NACKs or first requests sent, connections held.
    pub messages: AtomicUsize,
    pub refused: AtomicUsize,
}

fn node(i: usize) -> Option<SinkNode> {
    Some(SinkNode {
        id: format!("mcp-load-attacker-{i}"),
        annotations: Default::default(),
    })
}

/// Starts the attackers; they run until `stop`.
pub fn start(abuse: Abuse, tiny: bool, addr: SocketAddr, collection: String, stop: CancellationToken) -> Arc<Attack> {
    let attack = Arc::new(Attack::default());
    for i in 0..abuse.attackers(tiny) {
        let attack = attack.clone();
        let stop = stop.clone();
        let collection = collection.clone();
        tokio::spawn(async move {
            let result = match abuse {
                Abuse::NackFlood => nack_flood(i, addr, collection, &attack, &stop).await,
                Abuse::InitialVersions => initial_versions(i, addr, collection, &attack, &stop).await,
                Abuse::IdleConnections => idle_connection(addr, &attack, &stop).await,
            };
            if result.is_err() {
                attack.refused.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    attack
}

async fn channel(addr: SocketAddr) -> anyhow::Result<tonic::transport::Channel> {
    Ok(tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?)
}

async fn nack_flood(
    i: usize,
    addr: SocketAddr,
    collection: String,
    attack: &Attack,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let first = MeshConfigRequest {
        sink_node: node(i),
        type_url: collection.clone(),
        ..Default::default()
    };
    let (tx, mut inbound) = open(channel(addr).await?, SOTW_PATH, MCP, vec![first]).await?;
    attack.established.fetch_add(1, Ordering::Relaxed);
    // Just under the default --max-request-bytes (4 MiB).
    let message = "x".repeat((4 << 20) - 4096);
    loop {
        tokio::select! {
            response = inbound.message() => {
                let Some((envelope, _)) = response? else { return Ok(()) };
                tx.send(MeshConfigRequest {
                    version_info: String::new(),
                    sink_node: node(i),
                    type_url: collection.clone(),
                    response_nonce: envelope.nonce,
                    error_detail: Some(tonic_types::Status {
                        code: 3,
                        message: message.clone(),
                        details: vec![],
                    }),
                })
                .await?;
                attack.messages.fetch_add(1, Ordering::Relaxed);
            }
            _ = stop.cancelled() => return Ok(()),
        }
    }
}

async fn initial_versions(
    i: usize,
    addr: SocketAddr,
    collection: String,
    attack: &Attack,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let initial_resource_versions = (0..60_000)
        .map(|n| (format!("attacker-{i}/ghost-resource-{n:08}"), format!("{n:016x}")))
        .collect();
    let first = IncrementalMeshConfigRequest {
        sink_node: node(i),
        type_url: collection,
        initial_resource_versions,
        ..Default::default()
    };
    // The sender is kept: the stream stays open, never ACKing.
    let (_tx, mut inbound) = open(channel(addr).await?, INCREMENTAL_PATH, MCP, vec![first]).await?;
    attack.messages.fetch_add(1, Ordering::Relaxed);
    attack.established.fetch_add(1, Ordering::Relaxed);
    // Read every response, ACK none.
    loop {
        tokio::select! {
            response = inbound.message() => if response?.is_none() { return Ok(()) },
            _ = stop.cancelled() => return Ok(()),
        }
    }
}

async fn idle_connection(addr: SocketAddr, attack: &Attack, stop: &CancellationToken) -> anyhow::Result<()> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
    stream.write_all(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]).await?;
    attack.established.fetch_add(1, Ordering::Relaxed);
    attack.messages.fetch_add(1, Ordering::Relaxed);
    stop.cancelled().await;
    Ok(())
}
