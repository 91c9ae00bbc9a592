//! Every metric name the gateway records, declared in one place with its help
//! text. Labels are bounded: collection, code, reason, dialect, component;
//! never a client, a node id or an address.

use metrics::{describe_counter, describe_gauge};

/// Istio's own names, so existing alerts keep working.
pub const REQUEST_ACKS: &str = "istio_mcp_request_acks_total";
pub const REQUEST_NACKS: &str = "istio_mcp_request_nacks_total";
pub const RECONNECTIONS: &str = "istio_mcp_reconnections";
pub const CLIENTS: &str = "istio_mcp_clients_total";

pub const UPSTREAM_CONNECTED: &str = "mcp_gateway_upstream_connected";
pub const UPSTREAM_STREAM_TERMINATIONS: &str = "mcp_gateway_upstream_stream_terminations_total";
pub const UPSTREAM_REFUSED_COLLECTIONS: &str = "mcp_gateway_upstream_refused_collections_total";
pub const UPDATES_APPLIED: &str = "mcp_gateway_updates_applied_total";
pub const DOWNSTREAM_STREAMS: &str = "mcp_gateway_downstream_streams";
pub const DOWNSTREAM_PUSHES: &str = "mcp_gateway_downstream_pushes_total";
pub const DOWNSTREAM_STALE_REQUESTS: &str = "mcp_gateway_downstream_stale_requests_total";
pub const DOWNSTREAM_NACKS: &str = "mcp_gateway_downstream_nacks_total";

pub const COMPONENT_UPSTREAM: &str = "upstream";
pub const COMPONENT_DOWNSTREAM: &str = "downstream";

/// A gRPC code as a label value: its name, so a client's arbitrary number
/// cannot create new series (unknown numbers are `Unknown`).
pub fn code_label(code: i32) -> &'static str {
    match tonic::Code::from(code) {
        tonic::Code::Ok => "Ok",
        tonic::Code::Cancelled => "Cancelled",
        tonic::Code::Unknown => "Unknown",
        tonic::Code::InvalidArgument => "InvalidArgument",
        tonic::Code::DeadlineExceeded => "DeadlineExceeded",
        tonic::Code::NotFound => "NotFound",
        tonic::Code::AlreadyExists => "AlreadyExists",
        tonic::Code::PermissionDenied => "PermissionDenied",
        tonic::Code::ResourceExhausted => "ResourceExhausted",
        tonic::Code::FailedPrecondition => "FailedPrecondition",
        tonic::Code::Aborted => "Aborted",
        tonic::Code::OutOfRange => "OutOfRange",
        tonic::Code::Unimplemented => "Unimplemented",
        tonic::Code::Internal => "Internal",
        tonic::Code::Unavailable => "Unavailable",
        tonic::Code::DataLoss => "DataLoss",
        tonic::Code::Unauthenticated => "Unauthenticated",
    }
}

/// Registers the help text of every metric with the installed recorder.
pub fn describe() {
    describe_counter!(
        REQUEST_ACKS,
        "ACKs sent upstream (component=upstream) or received from clients (component=downstream)."
    );
    describe_counter!(
        REQUEST_NACKS,
        "NACKs sent upstream or received from clients, by gRPC code."
    );
    describe_counter!(RECONNECTIONS, "Upstream stream re-establishments.");
    describe_gauge!(CLIENTS, "Connected downstream streams.");
    describe_gauge!(UPSTREAM_CONNECTED, "1 while an upstream stream is established, else 0.");
    describe_counter!(UPSTREAM_STREAM_TERMINATIONS, "Upstream streams that ended, by reason.");
    describe_counter!(
        UPSTREAM_REFUSED_COLLECTIONS,
        "Collections the source refused (unsupported collection), dropped from the subscription."
    );
    describe_counter!(
        UPDATES_APPLIED,
        "Upstream updates applied to the cache, by collection and kind (full, incremental)."
    );
    describe_gauge!(
        DOWNSTREAM_STREAMS,
        "Open downstream streams by protocol (sotw, incremental)."
    );
    describe_counter!(
        DOWNSTREAM_PUSHES,
        "Responses written to downstream clients, by collection."
    );
    describe_counter!(
        DOWNSTREAM_STALE_REQUESTS,
        "Downstream requests ignored for a stale or unknown nonce, by collection."
    );
    describe_counter!(
        DOWNSTREAM_NACKS,
        "NACKs received from downstream clients, by collection."
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn code_labels_are_bounded_names() {
        assert_eq!(super::code_label(3), "InvalidArgument");
        assert_eq!(super::code_label(12345), "Unknown");
    }
}
