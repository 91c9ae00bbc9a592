//! The integration tests: one binary, a module per area. Real gRPC over
//! 127.0.0.1 with port 0; the fake Galley and the clients live in `helpers`.

mod helpers;

/// Counts the heap of the gateways the heap budgets measure (`budgets`).
#[global_allocator]
static ALLOCATOR: helpers::heap::Counting = helpers::heap::Counting;

mod access;
mod access_review;
mod admin;
mod browser;
mod budgets;
mod canary;
mod chain;
mod check;
mod ci_review;
mod decoders;
mod demand;
mod deploy;
mod dialects;
mod docs;
mod envoy;
mod envoy_order;
mod extensions;
mod failure_paths;
mod grants;
mod grpc;
mod history_persist;
mod incremental;
mod kubernetes;
mod layout;
mod limits;
mod load;
mod make_before_break;
mod operating;
mod process;
mod properties;
mod reconnect;
mod redaction;
mod resource_source;
mod rollout;
mod rules;
mod skew;
mod sotw;
mod source_command;
mod sources;
mod tls;
mod trust;
mod upstream;
mod xds;
