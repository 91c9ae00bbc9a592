//! Tools for operators and for measuring: the `check`, `client`, `status`
//! and `rollout` subcommands, the `source` subcommand's dial-out, and the fake
//! Galley that `mcp-load` (a binary of this crate, in `src/bin/mcp-load`)
//! and the integration tests share.

pub mod check;
pub mod client;
pub mod dial_out;
pub mod galley;
pub mod rollout;
pub mod status;
