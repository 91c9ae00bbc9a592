//! The skew of one body for one release: what in its bytes the release's
//! descriptors do not have. The body is read as it is on the wire (field
//! numbers, not names: that is what an older decoder sees), against the
//! release's message and, for the names shown, the gateway's own.

use prost::encoding::{decode_key, decode_varint, WireType};
use prost_reflect::{Kind, MessageDescriptor};

use super::releases::{Generation, Release, RELEASES};
use crate::source::proto_json::{self, PathStep};

/// The most drops kept per resource and generation; past it, only counted
/// (a body made of unknown fields costs a count, not memory).
pub const MAX_FINDINGS: usize = 16;

/// The gateway's descriptor of the message `type_url` names, if one of
/// Istio's kinds.
fn current_message(type_url: &str) -> Option<MessageDescriptor> {
    // Istio's kinds only, not the Envoy types the files source and the
    // config dump decode with (a gateway that only relays Galley's bytes
    // never decodes those).
    proto_json::ISTIO_LAZY.message(type_url.rsplit('/').next().unwrap_or(type_url))
}

/// Nesting deeper than this is not walked (protobuf's own default limit).
const MAX_DEPTH: usize = 100;

const ANY: &str = "google.protobuf.Any";

/// What a release lacks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DroppedKind {
    /// A field its message does not have: the decoder skips it.
    Field,
    /// A number its enum does not have, with the gateway's name for it (a
    /// release may know the name under another number: istio/api
    /// renumbered values). `None` in a body of a sensitive collection,
    /// whose values are never shown.
    EnumValue { number: Option<i32>, name: Option<String> },
    /// A message type it cannot resolve (inside an `Any`, or the body's own
    /// type): the whole value is unreadable to it.
    Type(String),
}

/// One thing a release's clients drop, at a path in the body.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Dropped {
    /// From the body's root (`trafficPolicy`, `outlierDetection`, ...);
    /// empty for the whole body.
    pub path: Vec<PathStep>,
    /// The same by the protos' field names (`traffic_policy`), which YAML
    /// may use instead: for finding its line.
    pub proto_path: Vec<PathStep>,
    pub kind: DroppedKind,
    /// The first release the gateway carries that has it; `None`: none of
    /// them (added after 1.7).
    pub added_in: Option<Generation>,
}

impl Dropped {
    /// The path as Istio's docs write a field: `spec.trafficPolicy...`.
    pub fn shown_path(&self) -> String {
        let inner = proto_json::display_path(&self.path);
        match (inner.is_empty(), inner.starts_with('[')) {
            (true, _) => "spec".to_owned(),
            (false, true) => format!("spec{inner}"),
            (false, false) => format!("spec.{inner}"),
        }
    }

    /// When it was added, as the messages say it.
    pub fn added(&self) -> String {
        match self.added_in {
            Some(release) => format!("added in {release}"),
            None => "added after 1.7".to_owned(),
        }
    }

    /// `Istio 1.1 clients drop spec.x.y (added in 1.5)`.
    pub fn message(&self, generation: Generation) -> String {
        self.message_for(&[generation])
    }

    /// As [`Dropped::message`], for the clients of several releases at once
    /// (`Istio 1.0, 1.1 and 1.2 clients drop …`).
    pub fn message_for(&self, releases: &[Generation]) -> String {
        let who = releases_shown(releases);
        let path = self.shown_path();
        match &self.kind {
            DroppedKind::Field => format!("Istio {who} clients drop {path} ({})", self.added()),
            DroppedKind::EnumValue {
                number: Some(number),
                name,
            } => format!(
                "Istio {who} clients read {path} = {number}{} as a value their enum lacks ({})",
                name.as_ref()
                    .map(|n| format!(" ({n} in the gateway's protos)"))
                    .unwrap_or_default(),
                self.added()
            ),
            DroppedKind::EnumValue { number: None, .. } => format!(
                "Istio {who} clients read {path} as a value their enum lacks ({})",
                self.added()
            ),
            DroppedKind::Type(name) => format!(
                "Istio {who} clients cannot read {path}: its type {name} is not in their protos ({})",
                self.added()
            ),
        }
    }
}

/// Releases as a sentence lists them: `1.0, 1.1 and 1.2`.
pub fn releases_shown(releases: &[Generation]) -> String {
    let shown: Vec<String> = releases.iter().map(ToString::to_string).collect();
    match shown.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// A resource's skew for one release.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ResourceSkew {
    /// At most [`MAX_FINDINGS`], in body order.
    pub dropped: Vec<Dropped>,
    /// How many more there were.
    pub more: usize,
}

impl ResourceSkew {
    pub fn is_empty(&self) -> bool {
        self.dropped.is_empty()
    }

    pub fn count(&self) -> usize {
        self.dropped.len() + self.more
    }
}

/// What a release's clients drop of a body of type `type_url` (the `Any`'s
/// value bytes). `None`: not an Istio kind of the releases' protos (Mixer's
/// `Struct` kinds, MeshConfig, Envoy's types): not checked, never guessed.
/// A body that does not decode is walked as far as it does (the gateway
/// serves it as the source sent it; what a client drops of it is what is
/// known).
///
/// `sensitive`: the body is of a sensitive collection, whose values are
/// never shown: a map's key is written `[redacted]` in a path, an enum's
/// number and name and an `Any`'s type are left out (the fields' names,
/// the schema's, are shown).
pub fn dropped_by(release: &Release, type_url: &str, body: &[u8], sensitive: bool) -> Option<ResourceSkew> {
    let name = type_url.rsplit('/').next().unwrap_or(type_url);
    let current = current_message(type_url);
    if !in_scope(name, current.as_ref()) {
        return None;
    }
    let mut walk = Walk {
        release,
        found: ResourceSkew::default(),
        path: Vec::new(),
        proto_path: Vec::new(),
        sensitive,
    };
    match release.message(name) {
        Some(old) => walk.message(body, current.as_ref(), &old, 0),
        None => walk.push(DroppedKind::Type(name.to_owned()), Anchor::Type(name)),
    }
    Some(walk.found)
}

/// An Istio kind: one of the releases has it, or the gateway encodes it as
/// one of Istio's (a kind added after 1.7).
fn in_scope(name: &str, current: Option<&MessageDescriptor>) -> bool {
    name.starts_with("istio.") && (current.is_some() || RELEASES.iter().any(|r| r.message(name).is_some()))
}

/// What a drop is, for finding the release that added it.
enum Anchor<'a> {
    Field { message: &'a str, number: u32 },
    EnumValue { name: &'a str, number: i32 },
    Type(&'a str),
}

impl Anchor<'_> {
    fn in_release(&self, release: &Release) -> bool {
        match self {
            Anchor::Field { message, number } => {
                release.message(message).is_some_and(|m| m.get_field(*number).is_some())
            }
            Anchor::EnumValue { name, number } => release
                .enumeration(name)
                .is_some_and(|e| e.get_value(*number).is_some()),
            Anchor::Type(name) => release.message(name).is_some(),
        }
    }
}

struct Walk<'r> {
    release: &'r Release,
    found: ResourceSkew,
    path: Vec<PathStep>,
    /// The same path by the protos' field names (`traffic_policy`), as YAML
    /// may spell it.
    proto_path: Vec<PathStep>,
    /// A body of a sensitive collection: no value of it in what is found.
    sensitive: bool,
}

impl Walk<'_> {
    fn push(&mut self, kind: DroppedKind, anchor: Anchor<'_>) {
        if self.found.dropped.len() >= MAX_FINDINGS {
            self.found.more += 1;
            return;
        }
        let added_in = RELEASES
            .iter()
            .filter(|r| r.generation > self.release.generation)
            .find(|r| anchor.in_release(r))
            .map(|r| r.generation);
        self.found.dropped.push(Dropped {
            path: self.path.clone(),
            proto_path: self.proto_path.clone(),
            kind,
            added_in,
        });
    }

    /// Walks one message's bytes: `old` is the release's descriptor of it,
    /// `current` the gateway's (for the names shown; `None` where the
    /// gateway does not know the message).
    fn message(&mut self, bytes: &[u8], current: Option<&MessageDescriptor>, old: &MessageDescriptor, depth: usize) {
        if depth > MAX_DEPTH {
            return;
        }
        // Repeated fields: the index of each occurrence, per field number.
        let mut seen: Vec<(u32, usize)> = Vec::new();
        for (number, wire_type, value) in fields(bytes) {
            let old_field = old.get_field(number);
            let current_field = current.and_then(|c| c.get_field(number));
            let named = current_field.as_ref().or(old_field.as_ref());
            let (name, proto_name) = named.map_or_else(
                || (format!("(field {number})"), format!("(field {number})")),
                |f| (f.json_name().to_owned(), f.name().to_owned()),
            );
            let list = named.is_some_and(|f| f.is_list());
            self.path.push(PathStep::Key(name));
            self.proto_path.push(PathStep::Key(proto_name));
            let index = list.then(|| {
                let at = match seen.iter_mut().find(|(n, _)| *n == number) {
                    Some((_, count)) => {
                        *count += 1;
                        *count - 1
                    }
                    None => {
                        seen.push((number, 1));
                        0
                    }
                };
                self.path.push(PathStep::Index(at));
                self.proto_path.push(PathStep::Index(at));
            });
            match old_field {
                None => self.push(
                    DroppedKind::Field,
                    Anchor::Field {
                        message: old.full_name(),
                        number,
                    },
                ),
                Some(field) => {
                    let current_kind = current_field.map(|f| f.kind());
                    self.value(
                        &field.kind(),
                        current_kind.as_ref(),
                        field.is_map(),
                        value,
                        wire_type,
                        depth,
                    );
                }
            }
            if index.is_some() {
                self.path.pop();
                self.proto_path.pop();
            }
            self.path.pop();
            self.proto_path.pop();
        }
    }

    /// One field's value: recursing into messages, checking enum values.
    fn value(
        &mut self,
        old: &Kind,
        current: Option<&Kind>,
        map: bool,
        value: Value<'_>,
        wire_type: WireType,
        depth: usize,
    ) {
        match (old, value) {
            (Kind::Message(old), Value::Bytes(bytes)) if map => {
                let current = match current {
                    Some(Kind::Message(m)) => Some(m.clone()),
                    _ => None,
                };
                self.map_entry(bytes, current.as_ref(), old, depth);
            }
            (Kind::Message(old), Value::Bytes(bytes)) if old.full_name() == ANY => self.any(bytes, depth),
            (Kind::Message(old), Value::Bytes(bytes)) => {
                let current = match current {
                    Some(Kind::Message(m)) => Some(m.clone()),
                    _ => None,
                };
                self.message(bytes, current.as_ref(), old, depth + 1);
            }
            (Kind::Enum(old), value) => {
                let mut check = |number: i32| {
                    if old.get_value(number).is_none() {
                        let name = match current {
                            Some(Kind::Enum(e)) if !self.sensitive => e.get_value(number).map(|v| v.name().to_owned()),
                            _ => None,
                        };
                        let shown = (!self.sensitive).then_some(number);
                        self.push(
                            DroppedKind::EnumValue { number: shown, name },
                            Anchor::EnumValue {
                                name: old.full_name(),
                                number,
                            },
                        );
                    }
                };
                match (value, wire_type) {
                    (Value::Varint(n), _) => check(n as i32),
                    // Packed.
                    (Value::Bytes(mut packed), WireType::LengthDelimited) => {
                        while !packed.is_empty() {
                            match decode_varint(&mut packed) {
                                Ok(n) => check(n as i32),
                                Err(_) => return,
                            }
                        }
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }

    /// A map entry: its key names the step (`labels.app`), its value is
    /// walked.
    fn map_entry(&mut self, bytes: &[u8], current: Option<&MessageDescriptor>, old: &MessageDescriptor, depth: usize) {
        let mut key = None;
        let mut entry_value = None;
        for (number, wire_type, value) in fields(bytes) {
            match (number, value) {
                (1, Value::Bytes(k)) => key = Some(String::from_utf8_lossy(k).into_owned()),
                (1, Value::Varint(k)) => key = Some(k.to_string()),
                (2, value) => entry_value = Some((value, wire_type)),
                _ => {}
            }
        }
        let (Some((value, wire_type)), Some(old_value)) = (entry_value, old.get_field(2)) else {
            return;
        };
        // The map's own step is the field's name: the key replaces nothing,
        // it is one more step.
        let key = match self.sensitive {
            true => PathStep::Key(crate::source::proto_json::REDACTED.to_owned()),
            false => PathStep::Key(key.unwrap_or_default()),
        };
        self.path.push(key.clone());
        self.proto_path.push(key);
        let current_kind = current.and_then(|c| c.get_field(2)).map(|f| f.kind());
        self.value(
            &old_value.kind(),
            current_kind.as_ref(),
            false,
            value,
            wire_type,
            depth + 1,
        );
        self.path.pop();
        self.proto_path.pop();
    }

    /// An `Any`: its type resolved in the release's protos, then walked.
    fn any(&mut self, bytes: &[u8], depth: usize) {
        let (type_url, inner) = any_parts(bytes);
        let name = type_url.rsplit('/').next().unwrap_or_default();
        if name.is_empty() {
            return;
        }
        let current = current_message(type_url);
        if !in_scope(name, current.as_ref()) && !name.starts_with("google.protobuf.") {
            // Envoy's or another project's type: not what the release's
            // Istio protos are about.
            return;
        }
        match self.release.message(name) {
            Some(old) => self.message(inner, current.as_ref(), &old, depth + 1),
            None => {
                // What a source wrote in the `Any`: a value.
                let shown = match self.sensitive {
                    true => crate::source::proto_json::REDACTED.to_owned(),
                    false => name.to_owned(),
                };
                self.push(DroppedKind::Type(shown), Anchor::Type(name))
            }
        }
    }
}

/// A field's value on the wire.
#[derive(Clone, Copy)]
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of a message's bytes, in order: (number, wire type, value).
/// Ends where the bytes stop decoding (a body cut short is walked as far as
/// it goes).
fn fields(mut bytes: &[u8]) -> impl Iterator<Item = (u32, WireType, Value<'_>)> {
    std::iter::from_fn(move || {
        if bytes.is_empty() {
            return None;
        }
        let (number, wire_type) = decode_key(&mut bytes).ok()?;
        let value = take_value(&mut bytes, wire_type)?;
        Some((number, wire_type, value))
    })
}

/// Takes one value of `wire_type` off the front of `bytes`; `None` when the
/// bytes end first (a body cut short is walked as far as it goes).
fn take_value<'a>(bytes: &mut &'a [u8], wire_type: WireType) -> Option<Value<'a>> {
    match wire_type {
        WireType::Varint => decode_varint(bytes).ok().map(Value::Varint),
        WireType::SixtyFourBit | WireType::ThirtyTwoBit => {
            let len = if wire_type == WireType::SixtyFourBit { 8 } else { 4 };
            let (_, rest) = bytes.split_at_checked(len)?;
            *bytes = rest;
            Some(Value::Fixed)
        }
        WireType::LengthDelimited => {
            let len = usize::try_from(decode_varint(bytes).ok()?).ok()?;
            let (value, rest) = bytes.split_at_checked(len)?;
            *bytes = rest;
            Some(Value::Bytes(value))
        }
        // Groups: proto3 has none; stop rather than guess their end.
        WireType::StartGroup | WireType::EndGroup => None,
    }
}

/// An `Any`'s type URL and value.
fn any_parts(bytes: &[u8]) -> (&str, &[u8]) {
    let (mut type_url, mut value) = ("", &[][..]);
    for (number, _, field) in fields(bytes) {
        match (number, field) {
            (1, Value::Bytes(url)) => type_url = std::str::from_utf8(url).unwrap_or_default(),
            (2, Value::Bytes(bytes)) => value = bytes,
            _ => {}
        }
    }
    (type_url, value)
}

/// The body (`Any` type URL and value) of an encoded MCP `Resource`
/// (`metadata` = 1, `body` = 2).
pub fn body_of(resource: &[u8]) -> Option<(&str, &[u8])> {
    let body = fields(resource)
        .filter_map(|(number, _, value)| match (number, value) {
            (2, Value::Bytes(bytes)) => Some(bytes),
            _ => None,
        })
        .last()?;
    Some(any_parts(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DESTINATION_RULE: &str = "type.googleapis.com/istio.networking.v1alpha3.DestinationRule";

    fn release(minor: u16) -> &'static Release {
        Generation::of(minor).release().unwrap()
    }

    fn encoded(type_url: &str, spec: serde_json::Value) -> Vec<u8> {
        proto_json::encode(type_url, spec).unwrap()
    }

    #[test]
    fn a_field_of_a_later_release_is_dropped_with_the_release_that_added_it() {
        let body = encoded(
            DESTINATION_RULE,
            json!({"host": "reviews", "trafficPolicy": {"outlierDetection": {
                "consecutive5xxErrors": 5, "interval": "60s", "baseEjectionTime": "180s"}}}),
        );
        let skew = dropped_by(release(1), DESTINATION_RULE, &body, false).unwrap();
        assert_eq!(skew.dropped.len(), 1, "{skew:?}");
        let dropped = &skew.dropped[0];
        assert_eq!(
            dropped.shown_path(),
            "spec.trafficPolicy.outlierDetection.consecutive5xxErrors"
        );
        assert_eq!(dropped.added_in, Some(Generation::of(5)));
        assert_eq!(
            dropped.message(Generation::of(1)),
            "Istio 1.1 clients drop spec.trafficPolicy.outlierDetection.consecutive5xxErrors (added in 1.5)"
        );
        // 1.5 and later read it whole.
        for minor in 5..=7 {
            assert!(dropped_by(release(minor), DESTINATION_RULE, &body, false)
                .unwrap()
                .is_empty());
        }
    }

    #[test]
    fn repeated_fields_and_map_values_are_named_by_index_and_key() {
        let url = "type.googleapis.com/istio.networking.v1alpha3.VirtualService";
        let body = encoded(
            url,
            json!({"hosts": ["a"], "http": [
                {"route": [{"destination": {"host": "a"}}]},
                {"route": [{"destination": {"host": "a"}}], "mirrorPercentage": {"value": 5.0}},
            ]}),
        );
        let skew = dropped_by(release(1), url, &body, false).unwrap();
        let paths: Vec<String> = skew.dropped.iter().map(Dropped::shown_path).collect();
        assert_eq!(paths, ["spec.http[1].mirrorPercentage"]);
        assert_eq!(skew.dropped[0].added_in, Some(Generation::of(5)));
    }

    /// In a body of a sensitive collection, what is dropped is said by the
    /// schema's names alone: a map's key, an enum's value and an `Any`'s
    /// type are values (the twenty-fourth check of issue 42).
    #[test]
    fn a_sensitive_bodys_values_are_never_in_what_is_dropped() {
        // VirtualService.http[0].match[0].headers["k-MARKER"] = a StringMatch
        // holding field 50, which no release has.
        let ld = |field: u32, bytes: &[u8]| {
            let mut out = Vec::new();
            prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, &mut out);
            prost::encoding::encode_varint(bytes.len() as u64, &mut out);
            out.extend_from_slice(bytes);
            out
        };
        let mut string_match = Vec::new();
        prost::encoding::encode_key(50, prost::encoding::WireType::Varint, &mut string_match);
        prost::encoding::encode_varint(1, &mut string_match);
        let entry = [ld(1, b"k-MARKER"), ld(2, &string_match)].concat();
        let body = ld(3, &ld(1, &ld(5, &entry)));
        let url = "type.googleapis.com/istio.networking.v1alpha3.VirtualService";
        let open = dropped_by(release(1), url, &body, false).unwrap();
        assert_eq!(
            open.dropped[0].shown_path(),
            "spec.http[0].match[0].headers.k-MARKER.(field 50)"
        );
        let hidden = dropped_by(release(1), url, &body, true).unwrap();
        assert_eq!(
            hidden.dropped[0].shown_path(),
            "spec.http[0].match[0].headers.[redacted].(field 50)"
        );

        let lb = encoded(
            DESTINATION_RULE,
            json!({"host": "r", "trafficPolicy": {"loadBalancer": {"simple": "ROUND_ROBIN"}}}),
        );
        let hidden = dropped_by(release(1), DESTINATION_RULE, &lb, true).unwrap();
        assert_eq!(
            hidden.dropped[0].kind,
            DroppedKind::EnumValue {
                number: None,
                name: None
            }
        );
        let said = hidden.dropped[0].message(Generation::of(1));
        assert_eq!(
            said,
            "Istio 1.1 clients read spec.trafficPolicy.loadBalancer.simple as a value their enum lacks (added after 1.7)"
        );
    }

    #[test]
    fn an_enum_value_a_release_lacks_is_named() {
        // istio/api renumbered the load balancer: ROUND_ROBIN was 0 up to
        // 1.7 and is 4 in the gateway's protos, a number no release the
        // gateway carries knows; RANDOM kept 2.
        let body = encoded(
            DESTINATION_RULE,
            json!({"host": "r", "trafficPolicy": {"loadBalancer": {"simple": "ROUND_ROBIN"}},
                   "subsets": [{"name": "v1", "trafficPolicy": {"loadBalancer": {"simple": "RANDOM"}}}]}),
        );
        let skew = dropped_by(release(1), DESTINATION_RULE, &body, false).unwrap();
        assert_eq!(skew.dropped.len(), 1, "{skew:?}");
        let dropped = &skew.dropped[0];
        assert_eq!(
            dropped.kind,
            DroppedKind::EnumValue {
                number: Some(4),
                name: Some("ROUND_ROBIN".into())
            }
        );
        assert_eq!(dropped.shown_path(), "spec.trafficPolicy.loadBalancer.simple");
        assert_eq!(dropped.added_in, None);
        assert_eq!(
            dropped.message(Generation::of(1)),
            "Istio 1.1 clients read spec.trafficPolicy.loadBalancer.simple = 4 (ROUND_ROBIN in the gateway's protos) as \
             a value their enum lacks (added after 1.7)"
        );
    }

    #[test]
    fn a_type_a_release_lacks_is_the_whole_resource() {
        let url = "type.googleapis.com/istio.networking.v1alpha3.Sidecar";
        let body = encoded(url, json!({"egress": [{"hosts": ["./*"]}]}));
        let skew = dropped_by(release(0), url, &body, false).unwrap();
        assert_eq!(skew.dropped.len(), 1);
        assert_eq!(
            skew.dropped[0].kind,
            DroppedKind::Type("istio.networking.v1alpha3.Sidecar".into())
        );
        assert_eq!(skew.dropped[0].shown_path(), "spec");
        assert_eq!(skew.dropped[0].added_in, Some(Generation::of(1)));
        assert!(dropped_by(release(1), url, &body, false).unwrap().is_empty());
    }

    #[test]
    fn types_outside_istio_kinds_are_not_checked() {
        let envoy = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        let body = encoded(envoy, json!({"name": "c"}));
        assert_eq!(dropped_by(release(1), envoy, &body, false), None);
        assert_eq!(
            dropped_by(release(1), "type.googleapis.com/google.protobuf.Struct", b"", false),
            None
        );
    }

    #[test]
    fn unknown_fields_are_counted_past_the_cap_and_cut_bodies_never_panic() {
        let mut body = encoded(DESTINATION_RULE, json!({"host": "r"}));
        for number in 100..140u32 {
            prost::encoding::string::encode(number, &"x".to_owned(), &mut body);
        }
        let skew = dropped_by(release(7), DESTINATION_RULE, &body, false).unwrap();
        assert_eq!(skew.dropped.len(), MAX_FINDINGS);
        assert_eq!(skew.count(), 40);
        assert_eq!(skew.dropped[0].shown_path(), "spec.(field 100)");
        assert_eq!(skew.dropped[0].added_in, None);
        for cut in 0..body.len() {
            let _ = dropped_by(release(1), DESTINATION_RULE, &body[..cut], false);
        }
    }

    #[test]
    fn a_resource_body_is_found_in_its_encoding() {
        let resource = crate::proto::wire::test_support::encoded_resource("ns/a", "1", b"\x0a\x01x");
        let (url, value) = body_of(&resource).unwrap();
        assert_eq!(url, "type.googleapis.com/x.Y");
        assert_eq!(value, b"\x0a\x01x");
    }
}
