//! What Envoy refuses in a resource it could decode: the protoc-gen-validate
//! rules (`validate.rules`, `validate.required`) its protos carry, which
//! Envoy checks on every resource it is sent (and on every `typed_config`
//! as it builds the extension) and NACKs on, read from the descriptors the
//! gateway embeds, generically: nothing here names an Envoy type but one
//! rule Envoy applies beyond its protos (a socket address is an IP address
//! unless a DNS cluster's endpoints or a resolver say otherwise).
//!
//! The subset read: a message field `required`; oneofs `required`; string
//! `const`, `len`, `min_len`, `max_len`, `len_bytes`, `min_bytes`,
//! `max_bytes`, `prefix`, `suffix`, `contains`, `not_contains`, `in`,
//! `not_in`, `ignore_empty`, the well-known `ip`, `ipv4`, `ipv6`,
//! `hostname`, `address` and the HTTP header name and value forms; bytes
//! lengths; bool `const`; every integer and float type's `const`, `lt`,
//! `lte`, `gt`, `gte` (ranges inside and outside, as PGV reads them), `in`,
//! `not_in`; enum `const`, `defined_only`, `in`, `not_in`; repeated
//! `min_items`, `max_items`, `ignore_empty` and `items`; map `min_pairs`,
//! `max_pairs`, `keys`, `values`; `Any` `required`, `in`, `not_in`;
//! duration `required`, `const`, `lt`, `lte`, `gt`, `gte`, `in`, `not_in`;
//! timestamp `required`; the scalar rules of a wrapper type
//! (`google.protobuf.UInt32Value`) on its value; messages marked
//! `validate.disabled` or `validate.ignored` are not checked. Not read:
//! `pattern` (RE2), `unique`, `email`, `uri`, `uuid`, timestamp bounds.
//!
//! `check` runs it; the served files source does not (a resource Envoy
//! refuses is still the operator's to serve).

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::IpAddr;

use prost_reflect::{
    DescriptorPool, DynamicMessage, ExtensionDescriptor, FieldDescriptor, Kind, ReflectMessage, Value,
};

use super::proto_json::{message_type, PathStep};

/// At most this many findings per resource.
const MAX_VIOLATIONS: usize = 100;

/// How deep messages are followed (Envoy's own recursion limit is larger;
/// a resource this deep is not a config anyone writes).
const MAX_DEPTH: usize = 64;

/// One rule a resource breaks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The field, by JSON names from the body's root (`loadAssignment.endpoints[0]`).
    pub path: Vec<PathStep>,
    /// The same by proto names (`load_assignment.endpoints[0]`).
    pub proto_path: Vec<PathStep>,
    /// What is wrong, in PGV's words (`value length must be at least 1 characters`).
    pub message: String,
    /// Whose rule it is: `validate.rules of envoy.config.core.v3.SocketAddress.address`.
    pub rule: String,
    /// The body's own text `message` repeats (an address that is no IP
    /// address), for a reader that must not show it (a sensitive collection).
    pub quotes: Option<String>,
}

impl Violation {
    /// `message` without the body's text it repeats, nor anything quoted.
    pub fn message_redacted(&self) -> String {
        let message = match &self.quotes {
            Some(text) if !text.is_empty() => self.message.replace(text.as_str(), super::proto_json::REDACTED),
            _ => self.message.clone(),
        };
        super::proto_json::redact_quoted(&message)
    }
}

/// The rules a body of `type_url` breaks (its `Any`s followed); nothing
/// for a type with no descriptor here or bytes that do not decode.
pub fn violations(type_url: &str, value: &[u8]) -> Vec<Violation> {
    let Some(descriptor) = message_type(type_url) else {
        return Vec::new();
    };
    let Ok(message) = DynamicMessage::decode(descriptor, value) else {
        return Vec::new();
    };
    let mut walk = Walk::default();
    walk.message(&message, 0);
    walk.found
}

/// The options of `validate.proto`, as a pool holds them.
struct Options {
    rules: ExtensionDescriptor,
    disabled: Option<ExtensionDescriptor>,
    ignored: Option<ExtensionDescriptor>,
    required: Option<ExtensionDescriptor>,
}

impl Options {
    fn of(pool: &DescriptorPool) -> Option<Self> {
        Some(Self {
            rules: pool.get_extension_by_name("validate.rules")?,
            disabled: pool.get_extension_by_name("validate.disabled"),
            ignored: pool.get_extension_by_name("validate.ignored"),
            required: pool.get_extension_by_name("validate.required"),
        })
    }
}

/// Whether `options` has the boolean `extension` set true.
fn flag(options: &DynamicMessage, extension: Option<&ExtensionDescriptor>) -> bool {
    extension.is_some_and(|e| options.has_extension(e) && options.get_extension(e).as_bool() == Some(true))
}

/// A field of a rules message, when it is set.
fn set<'a>(rules: &'a DynamicMessage, name: &str) -> Option<Cow<'a, Value>> {
    let field = rules.descriptor().get_field_by_name(name)?;
    rules.has_field(&field).then(|| rules.get_field(&field))
}

fn set_bool(rules: &DynamicMessage, name: &str) -> bool {
    set(rules, name).and_then(|v| v.as_bool()) == Some(true)
}

fn set_u64(rules: &DynamicMessage, name: &str) -> Option<u64> {
    set(rules, name).and_then(|v| v.as_u64())
}

fn set_str(rules: &DynamicMessage, name: &str) -> Option<String> {
    set(rules, name).and_then(|v| v.as_str().map(str::to_owned))
}

/// A repeated string field of a rules message (`in`, `not_in`).
fn strings(rules: &DynamicMessage, name: &str) -> Vec<String> {
    set(rules, name)
        .and_then(|v| {
            v.as_list()
                .map(|l| l.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
        })
        .unwrap_or_default()
}

/// The rules message of the `type` oneof of a `FieldRules` that is set, and its name.
fn rule_kind(rules: &DynamicMessage) -> Option<(String, DynamicMessage)> {
    rules
        .fields()
        .filter(|(field, _)| field.containing_oneof().is_some())
        .find_map(|(field, value)| Some((field.name().to_owned(), value.as_message()?.clone())))
}

#[derive(Default)]
struct Walk {
    path: Vec<PathStep>,
    proto_path: Vec<PathStep>,
    found: Vec<Violation>,
    /// Inside a DNS cluster's endpoints (or a custom cluster type's), where
    /// an address may be a host name.
    names_resolve: usize,
    /// Each field's rules, read from its options once (by full name).
    rules: HashMap<String, Option<DynamicMessage>>,
    /// Each message's `disabled`/`ignored` and each oneof's `required`,
    /// read once (by full name).
    flags: HashMap<String, bool>,
}

impl Walk {
    fn push(&mut self, json: PathStep, proto: PathStep) {
        self.path.push(json);
        self.proto_path.push(proto);
    }

    fn pop(&mut self) {
        self.path.pop();
        self.proto_path.pop();
    }

    fn violation(&mut self, rule: String, message: String) {
        self.violation_quoting(rule, message, None);
    }

    fn violation_quoting(&mut self, rule: String, message: String, quotes: Option<String>) {
        if self.found.len() < MAX_VIOLATIONS {
            self.found.push(Violation {
                path: self.path.clone(),
                proto_path: self.proto_path.clone(),
                message,
                rule,
                quotes,
            });
        }
    }

    fn message(&mut self, message: &DynamicMessage, depth: usize) {
        if depth > MAX_DEPTH || self.found.len() >= MAX_VIOLATIONS {
            return;
        }
        let descriptor = message.descriptor();
        if descriptor.full_name() == "google.protobuf.Any" {
            // Envoy checks a `typed_config` as the extension it holds.
            let type_url = message.get_field_by_name("type_url");
            let value = message.get_field_by_name("value");
            if let (Some(type_url), Some(value)) = (type_url, value) {
                if let (Some(type_url), Some(bytes)) = (type_url.as_str(), value.as_bytes()) {
                    if let Some(inner) =
                        message_type(type_url).and_then(|d| DynamicMessage::decode(d, bytes.clone()).ok())
                    {
                        self.message(&inner, depth + 1);
                    }
                }
            }
            return;
        }
        let Some(options) = Options::of(descriptor.parent_pool()) else {
            return;
        };
        let unchecked = self.flags.entry(descriptor.full_name().to_owned()).or_insert_with(|| {
            let message_options = descriptor.options();
            flag(&message_options, options.disabled.as_ref()) || flag(&message_options, options.ignored.as_ref())
        });
        if *unchecked {
            return;
        }
        for oneof in descriptor.oneofs().filter(|o| !o.is_synthetic()) {
            let required = *self
                .flags
                .entry(oneof.full_name().to_owned())
                .or_insert_with(|| flag(&oneof.options(), options.required.as_ref()));
            if required && !oneof.fields().any(|f| message.has_field(&f)) {
                let names: Vec<String> = oneof.fields().map(|f| f.json_name().to_owned()).collect();
                self.violation(
                    format!("validate.required of oneof {}", oneof.full_name()),
                    format!("one of {} is required", names.join(", ")),
                );
            }
        }
        self.socket_address(message);
        for field in descriptor.fields() {
            let rules = self
                .rules
                .entry(field.full_name().to_owned())
                .or_insert_with(|| {
                    let field_options = field.options();
                    (field_options.has_extension(&options.rules))
                        .then(|| field_options.get_extension(&options.rules).as_message().cloned())
                        .flatten()
                })
                .clone();
            let in_oneof = field.containing_oneof().is_some_and(|o| !o.is_synthetic());
            let present = message.has_field(&field);
            self.push(
                PathStep::Key(field.json_name().to_owned()),
                PathStep::Key(field.name().to_owned()),
            );
            if !present && in_oneof {
                // A oneof's field is checked only when it is the one set.
                self.pop();
                continue;
            }
            if !present && field.supports_presence() {
                // Unset: only a rule that it be set applies.
                if let Some((kind, typed)) = rules.as_ref().and_then(rule_kind) {
                    if matches!(kind.as_str(), "duration" | "any" | "timestamp") && set_bool(&typed, "required") {
                        self.violation(rules_of(&field), "value is required".into());
                    }
                }
                if rules
                    .as_ref()
                    .and_then(|r| set(r, "message"))
                    .and_then(|m| m.as_message().map(|m| set_bool(m, "required")))
                    == Some(true)
                {
                    self.violation(rules_of(&field), "value is required".into());
                }
                self.pop();
                continue;
            }
            let value = message.get_field(&field);
            let skip = rules
                .as_ref()
                .and_then(|r| set(r, "message"))
                .and_then(|m| m.as_message().map(|m| set_bool(m, "skip")))
                == Some(true);
            if let Some(rules) = &rules {
                self.field_rules(&field, rules, &value);
            }
            if !skip {
                let dns = self.enters_resolving_endpoints(message, &field);
                self.names_resolve += usize::from(dns);
                self.nested(&value, depth);
                self.names_resolve -= usize::from(dns);
            }
            self.pop();
        }
    }

    /// The messages in a field's value, each checked.
    fn nested(&mut self, value: &Value, depth: usize) {
        match value {
            Value::Message(inner) => self.message(inner, depth + 1),
            Value::List(items) => {
                for (index, item) in items.iter().enumerate() {
                    if let Value::Message(inner) = item {
                        self.push(PathStep::Index(index), PathStep::Index(index));
                        self.message(inner, depth + 1);
                        self.pop();
                    }
                }
            }
            Value::Map(entries) => {
                for (key, item) in entries {
                    if let Value::Message(inner) = item {
                        let key = map_key(key);
                        self.push(PathStep::Key(key.clone()), PathStep::Key(key));
                        self.message(inner, depth + 1);
                        self.pop();
                    }
                }
            }
            _ => {}
        }
    }

    /// A field's `validate.rules` on its value.
    fn field_rules(&mut self, field: &FieldDescriptor, rules: &DynamicMessage, value: &Value) {
        let Some((kind, typed)) = rule_kind(rules) else {
            return;
        };
        match (kind.as_str(), value) {
            ("repeated", Value::List(items)) => {
                let count = items.len() as u64;
                if count == 0 && set_bool(&typed, "ignore_empty") {
                    return;
                }
                self.counts(field, &typed, count, "min_items", "max_items", "items");
                if let Some(item_rules) = set(&typed, "items").and_then(|r| r.as_message().cloned()) {
                    for (index, item) in items.iter().enumerate() {
                        self.push(PathStep::Index(index), PathStep::Index(index));
                        self.field_rules(field, &item_rules, item);
                        self.pop();
                    }
                }
            }
            ("map", Value::Map(entries)) => {
                let count = entries.len() as u64;
                if count == 0 && set_bool(&typed, "ignore_empty") {
                    return;
                }
                self.counts(field, &typed, count, "min_pairs", "max_pairs", "pairs");
                let keys = set(&typed, "keys").and_then(|r| r.as_message().cloned());
                let values = set(&typed, "values").and_then(|r| r.as_message().cloned());
                for (key, item) in entries {
                    let shown = map_key(key);
                    self.push(PathStep::Key(shown.clone()), PathStep::Key(shown));
                    if let Some(keys) = &keys {
                        self.field_rules(field, keys, &key.clone().into());
                    }
                    if let Some(values) = &values {
                        self.field_rules(field, values, item);
                    }
                    self.pop();
                }
            }
            (_, Value::List(_) | Value::Map(_)) => {}
            (kind, value) => {
                let value = unwrapped(kind, value);
                if let Some(problem) = value.and_then(|value| scalar_problem(field, kind, &typed, &value)) {
                    self.violation(rules_of(field), problem);
                }
            }
        }
    }

    fn counts(
        &mut self,
        field: &FieldDescriptor,
        rules: &DynamicMessage,
        count: u64,
        min: &str,
        max: &str,
        what: &str,
    ) {
        if let Some(min) = set_u64(rules, min).filter(|min| count < *min) {
            self.violation(rules_of(field), format!("value must contain at least {min} {what}"));
        }
        if let Some(max) = set_u64(rules, max).filter(|max| count > *max) {
            self.violation(rules_of(field), format!("value must contain no more than {max} {what}"));
        }
    }

    /// Whether `field` of `message` leads to endpoints whose addresses Envoy
    /// resolves as host names: a Cluster's `load_assignment` when its type
    /// is STRICT_DNS or LOGICAL_DNS, or a custom `cluster_type`'s.
    fn enters_resolving_endpoints(&self, message: &DynamicMessage, field: &FieldDescriptor) -> bool {
        if field.name() != "load_assignment" {
            return false;
        }
        let by_name = |name: &str| {
            message
                .descriptor()
                .get_field_by_name(name)
                .filter(|f| message.has_field(f))
                .map(|f| message.get_field(&f).into_owned())
        };
        let dns_type = by_name("type")
            .and_then(|v| v.as_enum_number())
            .and_then(|n| message.descriptor().get_field_by_name("type").map(|f| (f, n)))
            .and_then(|(f, n)| match f.kind() {
                Kind::Enum(e) => e.get_value(n).map(|v| v.name().ends_with("DNS")),
                _ => None,
            })
            .unwrap_or(false);
        dns_type || by_name("cluster_type").is_some()
    }

    /// Envoy's rule beyond its protos: a socket address is an IP address
    /// (`malformed IP address`), unless a resolver is named or it is a DNS
    /// cluster's endpoint. Found by the shape of the message (an `address`
    /// string beside a `resolver_name`), not by its name.
    fn socket_address(&mut self, message: &DynamicMessage) {
        if self.names_resolve > 0 {
            return;
        }
        let descriptor = message.descriptor();
        let (Some(address), Some(resolver)) = (
            descriptor.get_field_by_name("address"),
            descriptor.get_field_by_name("resolver_name"),
        ) else {
            return;
        };
        let (Value::String(address_value), Value::String(resolver_value)) =
            (&*message.get_field(&address), &*message.get_field(&resolver))
        else {
            return;
        };
        if !resolver_value.is_empty() || address_value.is_empty() || address_value.parse::<IpAddr>().is_ok() {
            return;
        }
        self.push(
            PathStep::Key(address.json_name().to_owned()),
            PathStep::Key(address.name().to_owned()),
        );
        self.violation_quoting(
            format!("Envoy's own rule for {}", address.full_name()),
            format!(
                "malformed IP address: {address_value}; a host name needs a STRICT_DNS or LOGICAL_DNS cluster \
                 (or resolver_name)"
            ),
            Some(address_value.to_string()),
        );
        self.pop();
    }
}

/// Whose rule a field's is.
fn rules_of(field: &FieldDescriptor) -> String {
    format!("validate.rules of {}", field.full_name())
}

/// A map key as a path step.
fn map_key(key: &prost_reflect::MapKey) -> String {
    match key {
        prost_reflect::MapKey::Bool(v) => v.to_string(),
        prost_reflect::MapKey::I32(v) => v.to_string(),
        prost_reflect::MapKey::I64(v) => v.to_string(),
        prost_reflect::MapKey::U32(v) => v.to_string(),
        prost_reflect::MapKey::U64(v) => v.to_string(),
        prost_reflect::MapKey::String(v) => v.clone(),
    }
}

/// The value a scalar rule applies to: the value itself, or a wrapper's
/// (`google.protobuf.UInt32Value`) `value`; a duration or timestamp as it is.
fn unwrapped<'a>(kind: &str, value: &'a Value) -> Option<Cow<'a, Value>> {
    match value {
        Value::Message(wrapper) if !matches!(kind, "duration" | "timestamp" | "any" | "message") => {
            wrapper.get_field_by_name("value").map(|v| Cow::Owned(v.into_owned()))
        }
        value => Some(Cow::Borrowed(value)),
    }
}

/// What is wrong with a single value under the rules of `kind`, if anything.
fn scalar_problem(field: &FieldDescriptor, kind: &str, rules: &DynamicMessage, value: &Value) -> Option<String> {
    match (kind, value) {
        ("string", Value::String(text)) => string_problem(rules, text),
        ("bytes", Value::Bytes(bytes)) => {
            if bytes.is_empty() && set_bool(rules, "ignore_empty") {
                return None;
            }
            length_problem(rules, bytes.len() as u64, "len", "min_len", "max_len", "bytes")
        }
        ("bool", Value::Bool(v)) => set(rules, "const")
            .and_then(|c| c.as_bool())
            .filter(|c| c != v)
            .map(|c| format!("value must equal {c}")),
        ("enum", Value::EnumNumber(number)) => {
            let number = *number;
            if set_bool(rules, "defined_only") {
                if let Kind::Enum(values) = field.kind() {
                    if values.get_value(number).is_none() {
                        return Some(format!("value must be one of the defined enum values (not {number})"));
                    }
                }
            }
            number_problem(rules, Number::Int(number.into()), |v| {
                v.as_i32().map(|v| Number::Int(v.into()))
            })
        }
        ("duration", Value::Message(duration)) => number_problem(rules, Number::Int(nanos(duration)?), |v| {
            v.as_message().and_then(nanos).map(Number::Int)
        })
        .map(|problem| problem.replace("value", "duration")),
        ("any", Value::Message(any)) => {
            let type_url = any.get_field_by_name("type_url")?.as_str()?.to_owned();
            let allowed = strings(rules, "in");
            if !allowed.is_empty() && !allowed.contains(&type_url) {
                return Some(format!("type URL must be in list [{}]", allowed.join(", ")));
            }
            strings(rules, "not_in")
                .contains(&type_url)
                .then(|| format!("type URL {type_url} is not allowed here"))
        }
        (_, value) => match Number::of(value) {
            Some(number) => number_problem(rules, number, Number::of),
            None => None,
        },
    }
}

/// A duration in nanoseconds.
fn nanos(duration: &DynamicMessage) -> Option<i128> {
    let seconds = duration.get_field_by_name("seconds")?.as_i64()?;
    let nanos = duration.get_field_by_name("nanos")?.as_i32()?;
    Some(i128::from(seconds) * 1_000_000_000 + i128::from(nanos))
}

/// A number a rule compares: integers exactly, floats as floats.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
enum Number {
    Int(i128),
    Float(f64),
}

impl Number {
    fn of(value: &Value) -> Option<Self> {
        Some(match value {
            Value::I32(v) => Self::Int((*v).into()),
            Value::I64(v) => Self::Int((*v).into()),
            Value::U32(v) => Self::Int((*v).into()),
            Value::U64(v) => Self::Int((*v).into()),
            Value::F32(v) => Self::Float((*v).into()),
            Value::F64(v) => Self::Float(*v),
            _ => return None,
        })
    }

    fn as_f64(self) -> f64 {
        match self {
            Self::Int(v) => v as f64,
            Self::Float(v) => v,
        }
    }

    fn less(self, other: Self) -> bool {
        match (self, other) {
            (Self::Int(a), Self::Int(b)) => a < b,
            (a, b) => a.as_f64() < b.as_f64(),
        }
    }
}

impl std::fmt::Display for Number {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Int(v) => write!(f, "{v}"),
            Self::Float(v) => write!(f, "{v}"),
        }
    }
}

/// `const`, `in`, `not_in` and the range of `gt`/`gte` and `lt`/`lte`, as
/// PGV reads them: a lower bound above the upper one is a range outside.
fn number_problem(rules: &DynamicMessage, value: Number, read: impl Fn(&Value) -> Option<Number>) -> Option<String> {
    let bound = |name: &str| set(rules, name).and_then(|v| read(&v));
    if let Some(constant) = bound("const").filter(|c| *c != value) {
        return Some(format!("value must equal {constant}"));
    }
    let listed = |name: &str| -> Vec<Number> {
        set(rules, name)
            .and_then(|v| v.as_list().map(|l| l.iter().filter_map(&read).collect()))
            .unwrap_or_default()
    };
    let allowed = listed("in");
    if !allowed.is_empty() && !allowed.contains(&value) {
        let shown: Vec<String> = allowed.iter().map(ToString::to_string).collect();
        return Some(format!("value must be in list [{}]", shown.join(", ")));
    }
    if listed("not_in").contains(&value) {
        return Some(format!("value must not be {value}"));
    }
    // (bound, inclusive)
    let lower = bound("gt")
        .map(|b| (b, false))
        .or_else(|| bound("gte").map(|b| (b, true)));
    let upper = bound("lt")
        .map(|b| (b, false))
        .or_else(|| bound("lte").map(|b| (b, true)));
    let above = |(b, inclusive): (Number, bool)| if inclusive { !value.less(b) } else { b.less(value) };
    let below = |(b, inclusive): (Number, bool)| if inclusive { !b.less(value) } else { value.less(b) };
    let open = |(b, inclusive): (Number, bool), left: bool| match (inclusive, left) {
        (true, true) => format!("[{b}"),
        (false, true) => format!("({b}"),
        (true, false) => format!("{b}]"),
        (false, false) => format!("{b})"),
    };
    match (lower, upper) {
        (Some(l), None) if !above(l) => Some(format!(
            "value must be greater than {}{}",
            if l.1 { "or equal to " } else { "" },
            l.0
        )),
        (None, Some(u)) if !below(u) => Some(format!(
            "value must be less than {}{}",
            if u.1 { "or equal to " } else { "" },
            u.0
        )),
        (Some(l), Some(u)) if l.0.less(u.0) && !(above(l) && below(u)) => Some(format!(
            "value must be inside range {}, {}",
            open(l, true),
            open(u, false)
        )),
        (Some(l), Some(u)) if !(l.0.less(u.0) || above(l) || below(u)) => Some(format!(
            "value must be outside range {}, {}",
            open((u.0, !u.1), true),
            open((l.0, !l.1), false)
        )),
        _ => None,
    }
}

fn length_problem(rules: &DynamicMessage, len: u64, exact: &str, min: &str, max: &str, unit: &str) -> Option<String> {
    if let Some(want) = set_u64(rules, exact).filter(|want| len != *want) {
        return Some(format!("value length must be {want} {unit}"));
    }
    if let Some(min) = set_u64(rules, min).filter(|min| len < *min) {
        return Some(format!("value length must be at least {min} {unit}"));
    }
    set_u64(rules, max)
        .filter(|max| len > *max)
        .map(|max| format!("value length must be at most {max} {unit}"))
}

fn string_problem(rules: &DynamicMessage, text: &str) -> Option<String> {
    if text.is_empty() && set_bool(rules, "ignore_empty") {
        return None;
    }
    let chars = text.chars().count() as u64;
    if let Some(constant) = set_str(rules, "const").filter(|c| c != text) {
        return Some(format!("value must equal {constant:?}"));
    }
    let problem = length_problem(rules, chars, "len", "min_len", "max_len", "characters")
        .or_else(|| length_problem(rules, text.len() as u64, "len_bytes", "min_bytes", "max_bytes", "bytes"));
    if problem.is_some() {
        return problem;
    }
    /// A rule, whether a text holds to it, and what it asks, in words.
    type Affix = (&'static str, fn(&str, &str) -> bool, &'static str);
    let affixes: [Affix; 3] = [
        ("prefix", |t, s| t.starts_with(s), "have prefix"),
        ("suffix", |t, s| t.ends_with(s), "have suffix"),
        ("contains", |t, s| t.contains(s), "contain"),
    ];
    for (rule, holds, says) in affixes {
        if let Some(want) = set_str(rules, rule).filter(|want| !holds(text, want)) {
            return Some(format!("value must {says} {want:?}"));
        }
    }
    if let Some(not) = set_str(rules, "not_contains").filter(|not| text.contains(not.as_str())) {
        return Some(format!("value must not contain {not:?}"));
    }
    let allowed = strings(rules, "in");
    if !allowed.is_empty() && !allowed.iter().any(|a| a == text) {
        return Some(format!("value must be in list [{}]", allowed.join(", ")));
    }
    if strings(rules, "not_in").iter().any(|a| a == text) {
        return Some(format!("value must not be {text:?}"));
    }
    let strict = set(rules, "strict").and_then(|v| v.as_bool()).unwrap_or(true);
    let ip = text.parse::<IpAddr>();
    let well_known = [
        ("ip", ip.is_ok(), "a valid IP address"),
        ("ipv4", matches!(ip, Ok(IpAddr::V4(_))), "a valid IPv4 address"),
        ("ipv6", matches!(ip, Ok(IpAddr::V6(_))), "a valid IPv6 address"),
        ("hostname", is_hostname(text), "a valid hostname"),
        (
            "address",
            ip.is_ok() || is_hostname(text),
            "a valid hostname, or ip address",
        ),
    ];
    for (rule, holds, what) in well_known {
        if set_bool(rules, rule) && !holds {
            return Some(format!("value must be {what}"));
        }
    }
    match set(rules, "well_known_regex").and_then(|v| v.as_enum_number()) {
        // HTTP_HEADER_NAME
        Some(1) if !is_header_name(text, strict) => {
            Some("value does not match regex pattern of an HTTP header name".into())
        }
        // HTTP_HEADER_VALUE
        Some(2) if !is_header_value(text, strict) => {
            Some("value does not match regex pattern of an HTTP header value".into())
        }
        _ => None,
    }
}

/// PGV's hostname: at most 253 characters of labels of 1 to 63 letters,
/// digits and `-`, none starting or ending with `-` (a final `.` allowed).
fn is_hostname(text: &str) -> bool {
    let text = text.strip_suffix('.').unwrap_or(text);
    !text.is_empty()
        && text.len() <= 253
        && text.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

/// PGV's HTTP header name: strictly `^:?[0-9a-zA-Z!#$%&'*+-.^_|~\x60]+$`;
/// loosely (`strict: false`), PGV's header string: anything but NUL, CR
/// and LF, empty included.
fn is_header_name(text: &str, strict: bool) -> bool {
    if !strict {
        return !text.contains(['\0', '\r', '\n']);
    }
    let name = text.strip_prefix(':').unwrap_or(text);
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_|~`".contains(c))
}

/// PGV's HTTP header value: strictly no control character but a tab;
/// loosely, no NUL, CR or LF.
fn is_header_value(text: &str, strict: bool) -> bool {
    if strict {
        !text.chars().any(|c| c.is_ascii_control() && c != '\t')
    } else {
        !text.contains(['\0', '\r', '\n'])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::proto_json::{display_path, encode};
    use serde_json::json;

    const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

    fn found(type_url: &str, body: serde_json::Value) -> Vec<(String, String)> {
        let bytes = encode(type_url, body).unwrap();
        violations(type_url, &bytes)
            .into_iter()
            .map(|v| (display_path(&v.path), v.message))
            .collect()
    }

    fn static_cluster(address: &str, kind: &str) -> serde_json::Value {
        json!({"name": "c", "connect_timeout": "1s", "type": kind, "load_assignment": {"cluster_name": "c",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address":
                {"address": address, "port_value": 80}}}}]}]}})
    }

    #[test]
    fn a_valid_cluster_breaks_no_rule() {
        assert_eq!(found(CLUSTER, static_cluster("127.0.0.1", "STATIC")), []);
        assert_eq!(found(CLUSTER, static_cluster("::1", "STATIC")), []);
        // A DNS cluster's endpoints are host names.
        assert_eq!(found(CLUSTER, static_cluster("backend.example.com", "STRICT_DNS")), []);
    }

    #[test]
    fn an_address_that_is_no_ip_in_a_static_cluster_is_found() {
        let found = found(CLUSTER, static_cluster("not-an-ip", "STATIC"));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(
            found[0].0,
            "loadAssignment.endpoints[0].lbEndpoints[0].endpoint.address.socketAddress.address"
        );
        assert!(found[0].1.starts_with("malformed IP address: not-an-ip"), "{found:?}");
    }

    #[test]
    fn pgv_rules_are_read_from_the_descriptors() {
        // A port above 65535 (uint32 lte), an empty address (string
        // min_len), a negative timeout (duration gt), an Address with none
        // of its oneof (validate.required), repeated min_items.
        let body = json!({"name": "c", "connect_timeout": "-1s", "load_assignment": {"cluster_name": "c",
        "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "", "port_value": 70000}}}},
            {"endpoint": {"address": {}}},
        ]}]}});
        let found = found(CLUSTER, body);
        let paths: Vec<&str> = found.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "connectTimeout",
                "loadAssignment.endpoints[0].lbEndpoints[0].endpoint.address.socketAddress.address",
                "loadAssignment.endpoints[0].lbEndpoints[0].endpoint.address.socketAddress.portValue",
                "loadAssignment.endpoints[0].lbEndpoints[1].endpoint.address",
            ],
            "{found:?}"
        );
        assert!(found[0].1.contains("greater than 0"), "{found:?}");
        assert!(found[1].1.contains("at least 1 characters"), "{found:?}");
        assert!(found[2].1.contains("less than or equal to 65535"), "{found:?}");
        assert!(found[3].1.starts_with("one of socketAddress, pipe"), "{found:?}");
        // A route configuration's virtual host without domains.
        let found = super::tests::found(
            "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
            json!({"name": "r", "virtual_hosts": [{"name": "all", "domains": []}]}),
        );
        assert_eq!(
            found,
            [(
                "virtualHosts[0].domains".to_owned(),
                "value must contain at least 1 items".to_owned()
            )]
        );
    }

    #[test]
    fn ranges_read_as_pgv_reads_them() {
        let pool = message_type(CLUSTER).unwrap().parent_pool().clone();
        let rules = |json: serde_json::Value| {
            let descriptor = pool.get_message_by_name("validate.UInt32Rules").unwrap();
            DynamicMessage::deserialize(descriptor, json).unwrap()
        };
        let check = |r: &DynamicMessage, v: u32| number_problem(r, Number::Int(v.into()), Number::of);
        let inside = rules(json!({"gt": 0, "lt": 10}));
        assert_eq!(check(&inside, 5), None);
        assert_eq!(
            check(&inside, 10).as_deref(),
            Some("value must be inside range (0, 10)")
        );
        let outside = rules(json!({"gte": 10, "lte": 0}));
        assert_eq!(check(&outside, 0), None);
        assert_eq!(check(&outside, 11), None);
        assert!(check(&outside, 5).unwrap().contains("outside range"));
        assert_eq!(
            check(&rules(json!({"in": [1, 2]})), 3).as_deref(),
            Some("value must be in list [1, 2]")
        );
    }

    #[test]
    fn well_known_forms() {
        assert!(is_hostname("a-b.example.com") && is_hostname("x.") && !is_hostname("-a") && !is_hostname("a..b"));
        assert!(is_header_name(":path", true) && !is_header_name("a b", true) && is_header_name("a b", false));
        assert!(!is_header_name("", true) && is_header_name("", false) && !is_header_name("a\nb", false));
        assert!(is_header_value("a\tb", true) && !is_header_value("a\x01", true) && is_header_value("a\x01", false));
    }
}
