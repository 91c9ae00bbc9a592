//! Tools for operators and for measuring: the `client` subcommand. (`mcp-load`
//! is a binary of this crate, in `src/bin/mcp-load`.)

pub mod client;
