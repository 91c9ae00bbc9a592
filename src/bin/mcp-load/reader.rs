//! The clients' reader of responses: each message's envelope (version,
//! type, nonce) decoded as its bytes arrive, everything else skipped where
//! it lies in the HTTP/2 frames, never copied. Named clients (`eds.rs`) also
//! collect each resource and removed name, as slices of those frames (copied
//! only where a frame boundary cuts one).
//!
//! tonic's decoder copies each message into a buffer of the stream's that
//! grows to the largest message and keeps that size while the stream lives:
//! 32,000 streams of 285 KB states held 9 GB in the load tool alone, and the
//! copy was the largest share of the load's own CPU, on the core that
//! should be reading as fast as the gateway writes.

use std::collections::VecDeque;

use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use mcp_xds_gateway::transport::requests::{message_len, HEADER};
use tonic::body::Body;
use tonic::Status;

use crate::clients::Envelope;

/// The field numbers of a response's envelope.
#[derive(Clone, Copy, Debug)]
pub struct Fields {
    pub version: u32,
    /// The first value of this field is the type (a legacy incremental
    /// response's field 3 is its removed names; the load ignores them).
    pub type_url: u32,
    pub nonce: u32,
    /// The repeated field whose values are collected as the response's
    /// resources (0: none are).
    pub resources: u32,
    /// The repeated string field collected as its removed names (0: none).
    pub removed: u32,
}

/// Legacy MCP responses: `version_info` 1, `type_url` 3, `nonce` 4.
pub const MCP: Fields = Fields {
    version: 1,
    type_url: 3,
    nonce: 4,
    resources: 0,
    removed: 0,
};

/// Envoy's v3 responses, state of the world and delta: `version_info`
/// (`system_version_info`) 1, `type_url` 4, `nonce` 5.
pub const XDS: Fields = Fields {
    version: 1,
    type_url: 4,
    nonce: 5,
    resources: 0,
    removed: 0,
};

/// A v3 state-of-the-world response read by a named client: its resources
/// (`resources` 2, each an `Any`).
pub const XDS_SOTW_NAMED: Fields = Fields { resources: 2, ..XDS };

/// A v3 delta response read by a named client: its resources (`resources`
/// 2, each a `Resource`) and `removed_resources` (6).
pub const XDS_DELTA_NAMED: Fields = Fields {
    resources: 2,
    removed: 6,
    ..XDS
};

/// The longest envelope field kept; a longer one is an error.
const MAX_FIELD: usize = 64 << 10;

/// The longest resource collected; a longer one is an error.
const MAX_COLLECTED: usize = 16 << 20;

/// The responses of one stream: [`Responses::message`] yields each
/// message's envelope and size, `None` once the stream ends with OK.
pub struct Responses {
    body: Body,
    /// The status the stream ended with, once its trailers are read (or its
    /// headers, where it was answered with them alone).
    ended: Option<Status>,
    finished: bool,
    scan: Scan,
    ready: VecDeque<(Envelope, usize)>,
}

impl Responses {
    pub fn new(body: Body, ended: Option<Status>, fields: Fields) -> Self {
        Self {
            body,
            ended,
            finished: false,
            scan: Scan::new(fields),
            ready: VecDeque::new(),
        }
    }

    /// The next response's envelope and size in bytes (its gRPC frame's
    /// length); `None` once the stream has ended with OK; the stream's
    /// status where it ended otherwise.
    pub async fn message(&mut self) -> Result<Option<(Envelope, usize)>, Status> {
        loop {
            if let Some(message) = self.ready.pop_front() {
                return Ok(Some(message));
            }
            if self.finished {
                return Ok(None);
            }
            if let Some(status) = self.ended.take() {
                self.finished = true;
                return if status.code() == tonic::Code::Ok {
                    Ok(None)
                } else {
                    Err(status)
                };
            }
            let Some(frame) = self.body.frame().await else {
                self.finished = true;
                return Err(Status::internal(if self.scan.between_messages() {
                    "the response stream ended without a status"
                } else {
                    "the response stream ended inside a message"
                }));
            };
            let frame = frame?;
            match frame.into_data() {
                Ok(data) => self.scan.feed(data, &mut self.ready)?,
                Err(frame) => {
                    let status = frame
                        .trailers_ref()
                        .and_then(Status::from_header_map)
                        .unwrap_or_else(|| Status::internal("the response's trailers carry no grpc-status"));
                    self.ended = Some(status);
                }
            }
        }
    }
}

/// The value of the length-delimited field `number` of `message`, held
/// whole (the last one, as protobuf reads a singular field given twice).
pub fn length_delimited(mut message: &[u8], number: u32) -> Result<Option<&[u8]>, Status> {
    let malformed = |e: prost::DecodeError| Status::internal(format!("a malformed resource: {e}"));
    let mut found = None;
    while !message.is_empty() {
        let key = prost::encoding::decode_varint(&mut message).map_err(malformed)?;
        let skip = match key & 7 {
            0 => {
                prost::encoding::decode_varint(&mut message).map_err(malformed)?;
                0
            }
            1 => 8,
            5 => 4,
            2 => {
                let len = prost::encoding::decode_varint(&mut message).map_err(malformed)?;
                let len = usize::try_from(len).unwrap_or(usize::MAX);
                if len > message.len() {
                    return Err(past_the_end());
                }
                if key >> 3 == u64::from(number) {
                    found = Some(&message[..len]);
                }
                len
            }
            wire => return Err(Status::internal(format!("wire type {wire} in a resource"))),
        };
        if skip > message.len() {
            return Err(past_the_end());
        }
        message = &message[skip..];
    }
    Ok(found)
}

fn past_the_end() -> Status {
    Status::internal("a field runs past the end of its message")
}

/// Where the scanner is in a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// The gRPC frame's 5-byte prefix (compression flag, length).
    Prefix,
    /// A field's key (a varint).
    Key,
    /// A length-delimited field's length, and what its value is for.
    Len(Want),
    /// The bytes of the envelope's field `i`, `n` of them left.
    Take(usize, usize),
    /// The bytes of a value collected into list `i` (0 resources, 1
    /// removed names), `n` of them left.
    Collect(usize, usize),
    /// Bytes skipped, `n` of them left.
    Skip(usize),
    /// A varint field's value, skipped.
    SkipVarint,
}

/// What a length-delimited field's value is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    /// The envelope's field `i` (0 version, 1 type, 2 nonce).
    Envelope(usize),
    /// A value of collected list `i` (0 resources, 1 removed names).
    Collect(usize),
    Nothing,
}

/// A gRPC message stream scanned for one envelope per message.
struct Scan {
    fields: Fields,
    state: State,
    prefix: [u8; HEADER],
    have: usize,
    /// The current message's length and the bytes of it not yet scanned.
    size: usize,
    left: usize,
    varint: u64,
    shift: u32,
    taking: Vec<u8>,
    /// The envelope's fields seen so far: version, type, nonce.
    seen: [Option<String>; 3],
    /// The values collected so far: resources, removed names.
    collected: [Vec<Bytes>; 2],
    /// A collected value cut by a frame boundary, gathered.
    gathering: Vec<u8>,
}

impl Scan {
    fn new(fields: Fields) -> Self {
        Self {
            fields,
            state: State::Prefix,
            prefix: [0; HEADER],
            have: 0,
            size: 0,
            left: 0,
            varint: 0,
            shift: 0,
            taking: Vec::new(),
            seen: Default::default(),
            collected: Default::default(),
            gathering: Vec::new(),
        }
    }

    fn between_messages(&self) -> bool {
        self.state == State::Prefix && self.have == 0
    }

    /// Between two fields of a message (or before its first).
    fn at_field_boundary(&self) -> bool {
        self.state == State::Key && self.shift == 0
    }

    fn wanted(&self, field: u64) -> Want {
        let f = self.fields;
        if let Some(i) = [f.version, f.type_url, f.nonce]
            .iter()
            .position(|&n| u64::from(n) == field)
        {
            return Want::Envelope(i);
        }
        match [f.resources, f.removed]
            .iter()
            .position(|&n| n != 0 && u64::from(n) == field)
        {
            Some(i) => Want::Collect(i),
            None => Want::Nothing,
        }
    }

    /// Adds one byte to the varint being read; its value once complete.
    fn varint_byte(&mut self, byte: u8) -> Result<Option<u64>, Status> {
        if self.shift >= 64 {
            return Err(Status::internal("a varint longer than 10 bytes"));
        }
        self.varint |= u64::from(byte & 0x7f) << self.shift;
        self.shift += 7;
        if byte & 0x80 != 0 {
            return Ok(None);
        }
        let value = self.varint;
        self.varint = 0;
        self.shift = 0;
        Ok(Some(value))
    }

    /// Scans `data`, pushing each message completed in it to `out`.
    fn feed(&mut self, mut data: Bytes, out: &mut VecDeque<(Envelope, usize)>) -> Result<(), Status> {
        while data.has_remaining() {
            if self.state == State::Prefix {
                let n = (HEADER - self.have).min(data.len());
                self.prefix[self.have..self.have + n].copy_from_slice(&data[..n]);
                self.have += n;
                data.advance(n);
                if self.have < HEADER {
                    continue;
                }
                self.have = 0;
                self.size = message_len(&self.prefix)
                    .map_err(|_| Status::unimplemented("a compressed response; the load reads uncompressed ones"))?;
                self.left = self.size;
                self.state = State::Key;
            } else {
                let mut part = data.split_to(data.len().min(self.left));
                self.left -= part.len();
                while part.has_remaining() {
                    self.step(&mut part)?;
                }
            }
            if self.at_field_boundary() && self.left == 0 {
                let [version, type_url, nonce] = std::mem::take(&mut self.seen).map(Option::unwrap_or_default);
                let [resources, removed] = std::mem::take(&mut self.collected);
                out.push_back((
                    Envelope {
                        version,
                        type_url,
                        nonce,
                        resources,
                        removed,
                    },
                    self.size,
                ));
                self.state = State::Prefix;
            } else if self.left == 0 && self.state != State::Prefix {
                return Err(past_the_end());
            }
        }
        Ok(())
    }

    /// Scans what it can of `part`, all of it inside the current message.
    fn step(&mut self, part: &mut Bytes) -> Result<(), Status> {
        match self.state {
            State::Prefix => unreachable!("a message's bytes are scanned after its prefix"),
            State::Key => {
                if let Some(key) = self.varint_byte(part.get_u8())? {
                    self.state = match key & 7 {
                        0 => State::SkipVarint,
                        1 => State::Skip(8),
                        5 => State::Skip(4),
                        2 => State::Len(self.wanted(key >> 3)),
                        wire => return Err(Status::internal(format!("wire type {wire} in a response"))),
                    };
                }
            }
            State::Len(wanted) => {
                if let Some(len) = self.varint_byte(part.get_u8())? {
                    let len = usize::try_from(len).unwrap_or(usize::MAX);
                    if len > part.remaining() + self.left {
                        return Err(past_the_end());
                    }
                    self.state = match wanted {
                        Want::Envelope(i) if len > MAX_FIELD => {
                            return Err(Status::internal(format!(
                                "envelope field {i} of {len} bytes (at most {MAX_FIELD})"
                            )))
                        }
                        Want::Envelope(i) => State::Take(i, len),
                        Want::Collect(_) if len > MAX_COLLECTED => {
                            return Err(Status::internal(format!(
                                "a resource of {len} bytes (the load reads at most {MAX_COLLECTED})"
                            )))
                        }
                        Want::Collect(i) => State::Collect(i, len),
                        Want::Nothing => State::Skip(len),
                    };
                    self.end_field();
                }
            }
            State::Collect(i, n) if self.gathering.is_empty() && part.remaining() >= n => {
                // Whole in this frame: a slice of it, not a copy.
                self.collected[i].push(part.split_to(n));
                self.state = State::Key;
            }
            State::Collect(i, n) => {
                let k = n.min(part.remaining());
                self.gathering.extend_from_slice(&part[..k]);
                part.advance(k);
                self.state = State::Collect(i, n - k);
                self.end_field();
            }
            State::Take(i, n) => {
                let k = n.min(part.remaining());
                self.taking.extend_from_slice(&part[..k]);
                part.advance(k);
                self.state = State::Take(i, n - k);
                self.end_field();
            }
            State::Skip(n) => {
                let k = n.min(part.remaining());
                part.advance(k);
                self.state = State::Skip(n - k);
                self.end_field();
            }
            State::SkipVarint => {
                if self.varint_byte(part.get_u8())?.is_some() {
                    self.state = State::Key;
                }
            }
        }
        Ok(())
    }

    /// Back to the next key once a field's bytes are all read, keeping the
    /// first value of an envelope field and every collected value.
    fn end_field(&mut self) {
        match self.state {
            State::Take(i, 0) => {
                let value = String::from_utf8_lossy(&self.taking).into_owned();
                self.taking.clear();
                self.seen[i].get_or_insert(value);
                self.state = State::Key;
            }
            State::Collect(i, 0) => {
                self.collected[i].push(Bytes::from(std::mem::take(&mut self.gathering)));
                self.state = State::Key;
            }
            State::Skip(0) => self.state = State::Key,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mcp_xds_gateway::proto::envoy::service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse};
    use mcp_xds_gateway::proto::{IncrementalMeshConfigResponse, MeshConfigResponse, Resource};
    use proptest::prelude::*;

    /// `messages` as one gRPC stream, cut at `cuts` (offsets, any order).
    fn scan(fields: Fields, messages: &[Vec<u8>], cuts: &[usize]) -> Result<Vec<(Envelope, usize)>, Status> {
        let mut stream = Vec::new();
        for m in messages {
            stream.push(0);
            stream.extend_from_slice(&(m.len() as u32).to_be_bytes());
            stream.extend_from_slice(m);
        }
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
        cuts.push(stream.len());
        cuts.sort_unstable();
        let stream = Bytes::from(stream);
        let (mut scan, mut out, mut at) = (Scan::new(fields), VecDeque::new(), 0);
        for cut in cuts {
            scan.feed(stream.slice(at..cut), &mut out)?;
            at = cut;
        }
        assert!(scan.between_messages(), "every message was read whole");
        Ok(out.into_iter().collect())
    }

    fn resource(name: &str, body: usize) -> Resource {
        Resource {
            metadata: Some(mcp_xds_gateway::proto::Metadata {
                name: name.into(),
                version: "v1".into(),
                ..Default::default()
            }),
            body: Some(prost_types::Any {
                type_url: "type.googleapis.com/istio.networking.v1alpha3.ServiceEntry".into(),
                value: vec![7; body],
            }),
        }
    }

    fn sotw(version: &str, nonce: &str, bodies: &[usize]) -> MeshConfigResponse {
        MeshConfigResponse {
            version_info: version.into(),
            resources: bodies
                .iter()
                .enumerate()
                .map(|(i, b)| resource(&format!("r{i}"), *b))
                .collect(),
            type_url: "istio/networking/v1alpha3/serviceentries".into(),
            nonce: nonce.into(),
        }
    }

    proptest! {
        /// Whatever the frames' boundaries, the envelopes are prost's.
        #[test]
        fn legacy_envelopes_whatever_the_cuts(
            bodies in prop::collection::vec(prop::collection::vec(0usize..3000, 0..6), 1..4),
            cuts in prop::collection::vec(any::<usize>(), 0..40),
        ) {
            let responses: Vec<MeshConfigResponse> = bodies
                .iter()
                .enumerate()
                .map(|(i, b)| sotw(&format!("version-{i}"), &format!("nonce-{i}"), b))
                .collect();
            let messages: Vec<Vec<u8>> = responses.iter().map(prost::Message::encode_to_vec).collect();
            let scanned = scan(MCP, &messages, &cuts).unwrap();
            prop_assert_eq!(scanned.len(), responses.len());
            for ((envelope, size), (response, bytes)) in scanned.iter().zip(responses.iter().zip(&messages)) {
                prop_assert_eq!(&envelope.version, &response.version_info);
                prop_assert_eq!(&envelope.type_url, &response.type_url);
                prop_assert_eq!(&envelope.nonce, &response.nonce);
                prop_assert_eq!(*size, bytes.len());
            }
        }

        #[test]
        fn xds_envelopes_whatever_the_cuts(
            body in 0usize..5000,
            cuts in prop::collection::vec(any::<usize>(), 0..20),
        ) {
            let any = prost_types::Any { type_url: "t".into(), value: vec![1; body] };
            let sotw = DiscoveryResponse {
                version_info: "v7".into(),
                resources: vec![any.clone(), any],
                canary: true,
                type_url: "networking.istio.io/v1alpha3/ServiceEntry".into(),
                nonce: "n7".into(),
                ..Default::default()
            };
            let delta = DeltaDiscoveryResponse {
                system_version_info: "v8".into(),
                type_url: "networking.istio.io/v1alpha3/ServiceEntry".into(),
                removed_resources: vec!["gone".into()],
                nonce: "n8".into(),
                ..Default::default()
            };
            let messages = [prost::Message::encode_to_vec(&sotw), prost::Message::encode_to_vec(&delta)];
            let scanned = scan(XDS, &messages, &cuts).unwrap();
            prop_assert_eq!(scanned.len(), 2);
            prop_assert_eq!((&*scanned[0].0.version, &*scanned[0].0.nonce), ("v7", "n7"));
            prop_assert_eq!(&scanned[0].0.type_url, &sotw.type_url);
            prop_assert_eq!((&*scanned[1].0.version, &*scanned[1].0.nonce), ("v8", "n8"));
            prop_assert_eq!(scanned[1].1, messages[1].len());
        }
    }

    proptest! {
        /// A named client's resources and removed names, whatever the cuts:
        /// each value as prost encodes it, the envelope as before.
        #[test]
        fn named_resources_whatever_the_cuts(
            bodies in prop::collection::vec(0usize..3000, 0..6),
            removed in prop::collection::vec("[a-z-]{0,20}", 0..4),
            cuts in prop::collection::vec(any::<usize>(), 0..40),
        ) {
            use mcp_xds_gateway::proto::envoy::service::discovery::v3::Resource as DeltaResource;
            let anys: Vec<prost_types::Any> = bodies
                .iter()
                .map(|b| prost_types::Any { type_url: "t".into(), value: vec![3; *b] })
                .collect();
            let sotw = DiscoveryResponse {
                version_info: "v1".into(),
                resources: anys.clone(),
                type_url: "t".into(),
                nonce: "n1".into(),
                ..Default::default()
            };
            let delta = DeltaDiscoveryResponse {
                system_version_info: "v2".into(),
                resources: anys
                    .iter()
                    .enumerate()
                    .map(|(i, any)| DeltaResource {
                        name: format!("r{i}"),
                        version: "x".into(),
                        resource: Some(any.clone()),
                        ..Default::default()
                    })
                    .collect(),
                type_url: "t".into(),
                removed_resources: removed.clone(),
                nonce: "n2".into(),
                ..Default::default()
            };
            let sotw_bytes = prost::Message::encode_to_vec(&sotw);
            let delta_bytes = prost::Message::encode_to_vec(&delta);
            let scanned = scan(XDS_SOTW_NAMED, &[sotw_bytes.clone(), sotw_bytes], &cuts).unwrap();
            for (envelope, _) in &scanned {
                prop_assert_eq!((&*envelope.version, &*envelope.nonce), ("v1", "n1"));
                let expected: Vec<Vec<u8>> = anys.iter().map(prost::Message::encode_to_vec).collect();
                let got: Vec<Vec<u8>> = envelope.resources.iter().map(|r| r.to_vec()).collect();
                prop_assert_eq!(got, expected);
                prop_assert!(envelope.removed.is_empty());
            }
            let scanned = scan(XDS_DELTA_NAMED, &[delta_bytes], &cuts).unwrap();
            let envelope = &scanned[0].0;
            prop_assert_eq!((&*envelope.version, &*envelope.nonce), ("v2", "n2"));
            let expected: Vec<Vec<u8>> = delta.resources.iter().map(prost::Message::encode_to_vec).collect();
            let got: Vec<Vec<u8>> = envelope.resources.iter().map(|r| r.to_vec()).collect();
            prop_assert_eq!(got, expected);
            let got: Vec<&[u8]> = envelope.removed.iter().map(|r| &r[..]).collect();
            let expected: Vec<&[u8]> = removed.iter().map(|r| r.as_bytes()).collect();
            prop_assert_eq!(got, expected);
            // Read as plain XDS, nothing is collected.
            let plain = scan(XDS, &[prost::Message::encode_to_vec(&delta)], &cuts).unwrap();
            prop_assert!(plain[0].0.resources.is_empty() && plain[0].0.removed.is_empty());
        }
    }

    #[test]
    fn a_field_is_read_from_a_message_held_whole() {
        let any = prost::Message::encode_to_vec(&prost_types::Any {
            type_url: "t".into(),
            value: b"body".to_vec(),
        });
        assert_eq!(length_delimited(&any, 2).unwrap(), Some(&b"body"[..]));
        assert_eq!(length_delimited(&any, 7).unwrap(), None);
        // Varint, fixed64 and fixed32 fields are stepped over; the last of a
        // repeated singular field wins.
        let mixed = [
            0x08, 0x96, 0x01, 0x11, 0, 0, 0, 0, 0, 0, 0, 0, 0x1d, 0, 0, 0, 0, 0x12, 1, b'a', 0x12, 1, b'b',
        ];
        assert_eq!(length_delimited(&mixed, 2).unwrap(), Some(&b"b"[..]));
        assert!(length_delimited(&[0x12, 5, b'a'], 2)
            .unwrap_err()
            .message()
            .contains("past the end"));
        assert!(length_delimited(&[0x11, 0], 2)
            .unwrap_err()
            .message()
            .contains("past the end"));
        assert!(length_delimited(&[0x0b], 2)
            .unwrap_err()
            .message()
            .contains("wire type 3"));
        assert!(length_delimited(&[0x08], 2).is_err(), "a varint cut short");
    }

    #[test]
    fn an_empty_message_is_an_empty_envelope() {
        let scanned = scan(MCP, &[Vec::new(), Vec::new()], &[3]).unwrap();
        assert_eq!(scanned.len(), 2);
        assert_eq!((scanned[0].0.version.as_str(), scanned[0].1), ("", 0));
    }

    #[test]
    fn the_first_removed_name_is_a_legacy_incremental_response_type() {
        let response = IncrementalMeshConfigResponse {
            system_version_info: "v2".into(),
            removed_resources: vec!["first".into(), "second".into()],
            nonce: "n2".into(),
            ..Default::default()
        };
        let scanned = scan(MCP, &[prost::Message::encode_to_vec(&response)], &[]).unwrap();
        assert_eq!(scanned[0].0.type_url, "first");
        assert_eq!(scanned[0].0.nonce, "n2");
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        // A field whose length runs past the message.
        let long = vec![0x0a, 0x05, b'a'];
        assert!(scan(MCP, &[long], &[]).unwrap_err().message().contains("past the end"));
        // A key cut by the message's end.
        assert!(scan(MCP, &[vec![0x80]], &[])
            .unwrap_err()
            .message()
            .contains("past the end"));
        // A group.
        assert!(scan(MCP, &[vec![0x0b]], &[])
            .unwrap_err()
            .message()
            .contains("wire type 3"));
        // An eleven-byte varint.
        assert!(scan(
            MCP,
            &[vec![
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01
            ]],
            &[]
        )
        .unwrap_err()
        .message()
        .contains("longer than 10 bytes"));
        // A resource longer than the load collects, in a message that says
        // it holds it.
        let len = MAX_COLLECTED as u64 + 1;
        let mut message = vec![0];
        message.extend_from_slice(&(len as u32 + 8).to_be_bytes());
        message.push(0x12);
        prost::encoding::encode_varint(len, &mut message);
        let err = Scan::new(XDS_SOTW_NAMED)
            .feed(Bytes::from(message), &mut VecDeque::new())
            .unwrap_err();
        assert!(err.message().contains("at most"), "{err}");
        // A compressed message.
        let mut scan = Scan::new(MCP);
        let err = scan
            .feed(Bytes::from_static(&[1, 0, 0, 0, 0]), &mut VecDeque::new())
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unimplemented);
    }
}
