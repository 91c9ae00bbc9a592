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

/// Text a client or a source wrote, as an operator's terminal may show it:
/// the crate's one rule (`transport::safe_text`), which the admin port and
/// the JSON log share.
pub use crate::transport::safe_text::{json_terminal_safe, terminal_safe, yaml_terminal_safe};
