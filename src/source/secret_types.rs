// The collections of secrets, from the descriptors: shared by build.rs
// (which writes the list the gateway is built with, so no descriptor pool is
// decoded at start for it) and by `source::proto_json`'s test, which checks
// the list against the descriptors the gateway embeds.

/// How many fields deep a secret may lie for its type to be a collection of
/// secrets: Envoy's `Secret` holds its key two fields down
/// (`tls_certificate.private_key`, `generic_secret.secret`,
/// `session_ticket_keys.keys`).
const SECRET_DEPTH: usize = 2;

/// The field options that mark a secret: `(udpa.annotations.sensitive) =
/// true` (field number 76569463 on `google.protobuf.FieldOptions`), which
/// Envoy's protos use, and its successor in CNCF xds,
/// `(xds.annotations.v3.sensitive)` (61008053).
pub const SENSITIVE_OPTIONS: &[&str] = &["udpa.annotations.sensitive", "xds.annotations.v3.sensitive"];

/// Whether a field of `pool` carries either mark; `None` when the pool
/// defines neither option.
pub fn sensitive_marks(
    pool: &prost_reflect::DescriptorPool,
) -> Option<impl Fn(&prost_reflect::FieldDescriptor) -> bool> {
    let options: Vec<_> = SENSITIVE_OPTIONS
        .iter()
        .filter_map(|name| pool.get_extension_by_name(name))
        .collect();
    if options.is_empty() {
        return None;
    }
    Some(move |field: &prost_reflect::FieldDescriptor| {
        let set = field.options();
        options
            .iter()
            .any(|option| set.has_extension(option) && set.get_extension(option).as_bool() == Some(true))
    })
}

/// The type URL of every message of `pool` whose values *are* secrets: a
/// field marked sensitive ([`SENSITIVE_OPTIONS`]) at most
/// [`SECRET_DEPTH`] fields down, sorted. Deeper secrets do not count: every
/// Envoy resource reaches a private key through a `ConfigSource`'s gRPC
/// credentials (seven fields down), and serving no cluster without a policy
/// would be no default at all; the views still redact such a key wherever it
/// is.
pub fn secret_type_urls_of(pool: &prost_reflect::DescriptorPool) -> Vec<String> {
    let Some(marked) = sensitive_marks(pool) else {
        return Vec::new();
    };
    fn within(
        message: &prost_reflect::MessageDescriptor,
        depth: usize,
        marked: &dyn Fn(&prost_reflect::FieldDescriptor) -> bool,
    ) -> bool {
        message.fields().any(|field| {
            marked(&field)
                || (depth > 1
                    && matches!(field.kind(), prost_reflect::Kind::Message(inner) if within(&inner, depth - 1, marked)))
        })
    }
    let mut urls: Vec<String> = pool
        .all_messages()
        .filter(|m| within(m, SECRET_DEPTH, &marked))
        .map(|m| format!("type.googleapis.com/{}", m.full_name()))
        .collect();
    urls.sort_unstable();
    urls
}
