//! Where the cache's content comes from, across gateways: this gateway's id,
//! and the chain of gateways upstream of it (learned from the upstream when
//! it is another gateway). Downstream announces `[this, upstream...]` to the
//! gateways chained behind it, so a loop or an over-long chain is refused
//! where it would form.

use std::hash::{BuildHasher, Hasher};

use tokio::sync::watch;

use crate::SharedStr;

/// The sink-node annotation in which a gateway announces itself to its
/// upstream.
pub const GATEWAY_ID_ANNOTATION: &str = "mcp-xds-gateway/id";

/// The response header in which a gateway announces itself and the gateways
/// upstream of it (nearest first, comma-separated) to a gateway chained
/// behind it.
pub const CHAIN_HEADER: &str = "x-mcp-gateway-chain";

#[derive(Debug)]
pub struct Provenance {
    /// Random per process: two gateways never share one.
    pub gateway_id: SharedStr,
    upstream_chain: watch::Sender<Vec<SharedStr>>,
}

impl Default for Provenance {
    fn default() -> Self {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(std::time::UNIX_EPOCH.elapsed().map_or(0, |d| d.as_nanos()));
        hasher.write_u32(std::process::id());
        Self {
            gateway_id: format!("gw-{:016x}", hasher.finish()).into(),
            upstream_chain: watch::Sender::new(Vec::new()),
        }
    }
}

impl Provenance {
    /// The gateways upstream of this one, nearest first.
    pub fn upstream_chain(&self) -> Vec<SharedStr> {
        self.upstream_chain.borrow().clone()
    }

    /// Sees every change of the upstream chain.
    pub fn watch_upstream_chain(&self) -> watch::Receiver<Vec<SharedStr>> {
        self.upstream_chain.subscribe()
    }

    /// What this gateway announces downstream: itself, then its upstream
    /// chain, comma-separated.
    pub fn announced(&self) -> String {
        std::iter::once(self.gateway_id.clone())
            .chain(self.upstream_chain())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub(super) fn set_upstream_chain(&self, chain: Vec<SharedStr>) {
        self.upstream_chain.send_if_modified(|current| {
            let changed = *current != chain;
            *current = chain;
            changed
        });
    }
}

/// The chain another gateway announced (`announced`), nearest first.
pub fn parse_chain(header: &str) -> Vec<SharedStr> {
    header
        .split(',')
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map(SharedStr::from)
        .collect()
}

/// Why a gateway refuses an upstream's chain.
#[derive(Debug, PartialEq, Eq)]
pub enum ChainError {
    /// This gateway is upstream of itself.
    Loop { chain: Vec<SharedStr> },
    /// More gateways than `--max-chain-depth`.
    TooLong { chain: Vec<SharedStr>, max: usize },
}

impl std::fmt::Display for ChainError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChainError::Loop { chain } => write!(
                f,
                "the upstream's chain of gateways ({}) includes this gateway: a loop; fix --upstream so that \
                 config flows one way",
                chain.join(" <- ")
            ),
            ChainError::TooLong { chain, max } => write!(
                f,
                "the upstream is a chain of {} gateways ({}); with this one that is more than \
                 --max-chain-depth={max}",
                chain.len(),
                chain.join(" <- ")
            ),
        }
    }
}

impl Provenance {
    /// Checks the chain an upstream announced: this gateway must not be in
    /// it, and with this gateway it must be at most `max` long.
    pub fn check_upstream(&self, chain: &[SharedStr], max: usize) -> Result<(), ChainError> {
        if chain.contains(&self.gateway_id) {
            return Err(ChainError::Loop { chain: chain.to_vec() });
        }
        if chain.len() + 1 > max {
            return Err(ChainError::TooLong {
                chain: chain.to_vec(),
                max,
            });
        }
        Ok(())
    }

    /// Whether a downstream peer announcing `peer` as its id would close a
    /// loop: it is this gateway, or upstream of it.
    pub fn is_upstream_or_self(&self, peer: &str) -> bool {
        *self.gateway_id == *peer || self.upstream_chain.borrow().iter().any(|id| **id == *peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_with_this_gateway_is_a_loop_and_a_long_one_is_refused() {
        let me = Provenance::default();
        let other = Provenance::default();
        assert_ne!(me.gateway_id, other.gateway_id);
        let a: SharedStr = "gw-a".into();
        let b: SharedStr = "gw-b".into();
        assert_eq!(me.check_upstream(&[a.clone(), b.clone()], 4), Ok(()));
        assert_eq!(me.check_upstream(&[a.clone(), b.clone(), "gw-c".into()], 4), Ok(()));
        let long = vec![a.clone(), b.clone(), "gw-c".into(), "gw-d".into()];
        assert!(matches!(
            me.check_upstream(&long, 4),
            Err(ChainError::TooLong { max: 4, .. })
        ));
        let looped = vec![a.clone(), me.gateway_id.clone()];
        let err = me.check_upstream(&looped, 4).unwrap_err();
        assert!(matches!(err, ChainError::Loop { .. }));
        assert!(err.to_string().contains("a loop"), "{err}");
        assert_eq!(parse_chain(" gw-a, ,gw-b "), vec![a.clone(), b]);
        me.set_upstream_chain(vec![a]);
        assert!(me.is_upstream_or_self("gw-a"));
        assert!(me.is_upstream_or_self(&me.gateway_id.clone()));
        assert!(!me.is_upstream_or_self("gw-z"));
        assert_eq!(me.announced(), format!("{},gw-a", me.gateway_id));
    }
}
