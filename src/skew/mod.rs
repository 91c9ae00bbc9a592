//! Version skew: what a client of each Istio release would silently drop of
//! what the gateway serves.
//!
//! Config is written for the newest control plane and read by every older
//! one during a migration. A field an older release's protos lack is skipped
//! by that release's decoder without a word (Pilot 1.1 keeps an
//! `outlierDetection` without `consecutive5xxErrors`, a 1.5 field, and loses
//! its error threshold), so nothing NACKs and every view says SYNCED.
//!
//! - `releases.rs`: each release's descriptor set (compiled by `build.rs`
//!   from `proto/istio-api-releases/`), and a client's generation: which
//!   release it is, and what that was learned from.
//! - `walk.rs`: the skew of one body for one release: the field paths,
//!   enum values and `Any` types in its bytes that the release's descriptors
//!   do not have, each with the release that added it.
//! - `tracker.rs`: the skew of every served collection for every generation
//!   a connected client is of, kept as the cache changes at the cost of the
//!   change (one check per changed resource and generation in use), counted
//!   in `mcp_gateway_skew_resources`.

mod releases;
mod tracker;
mod walk;

pub use releases::{ClientGeneration, Generation, GenerationRules, GenerationRulesError, Learned, Release, RELEASES};
pub use tracker::{Interest, ServedBy, SkewTracker, TrackedSkew};
pub use walk::{body_of, dropped_by, releases_shown, Dropped, DroppedKind, ResourceSkew, MAX_FINDINGS};
