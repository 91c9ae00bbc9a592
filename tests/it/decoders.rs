//! Arbitrary bytes into every decoder the gateway runs on what a peer or a
//! file gives it: an error or a value, never a panic.

use bytes::Bytes;
use mcp_xds_gateway::collections::CollectionTable;
use mcp_xds_gateway::proto::wire::{self, ErrorDetail, IncrementalRequest, RawResource, RawResources, SotwRequest};
use proptest::prelude::*;
use prost::Message;

fn any_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..512)
}

/// Protobuf-looking bytes: valid keys and lengths more often than noise.
fn protobuf_like() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![
            (1u8..16, any::<u8>()).prop_map(|(field, v)| vec![field << 3, v & 0x7f]),
            (1u8..16, prop::collection::vec(any::<u8>(), 0..40)).prop_map(|(field, body)| {
                let mut bytes = vec![(field << 3) | 2, body.len() as u8];
                bytes.extend(body);
                bytes
            }),
            any::<u8>().prop_map(|b| vec![b]),
        ],
        0..24,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn downstream_requests_never_panic(bytes in prop_oneof![any_bytes(), protobuf_like()]) {
        if let Ok(request) = SotwRequest::decode(bytes.as_slice()) {
            if let Some(detail) = request.error_detail {
                let _ = ErrorDetail::parse(detail, 64);
            }
        }
        if let Ok(request) = IncrementalRequest::decode(Bytes::from(bytes.clone())) {
            for entry in &request.initial_resource_versions {
                let _ = wire::version_entry(entry);
            }
            if let Some(detail) = request.error_detail {
                let _ = ErrorDetail::parse(detail, 64);
            }
        }
        let _ = ErrorDetail::parse(Bytes::from(bytes.clone()), 16);
        let _ = wire::version_entry(&bytes);
    }

    #[test]
    fn upstream_messages_never_panic(bytes in prop_oneof![any_bytes(), protobuf_like()], resources in prop::collection::vec(protobuf_like(), 0..6)) {
        let _ = RawResources::decode(Bytes::from(bytes.clone()));
        let _ = RawResource::decode(Bytes::from(bytes));
        let raw: Vec<Bytes> = resources.into_iter().map(Bytes::from).collect();
        let _ = mcp_xds_gateway::source::validate::decode_resources("istio/networking/v1alpha3/gateways", &raw);
    }

    #[test]
    fn cache_files_never_panic(bytes in any_bytes(), tail in protobuf_like()) {
        let _ = mcp_xds_gateway::source::persisted::decode(&bytes);
        // A valid header and checksum over arbitrary protobuf.
        let mut file = b"mcp-xds-gateway\n".to_vec();
        file.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&tail).to_le_bytes());
        file.extend_from_slice(&tail);
        if let Ok(message) = mcp_xds_gateway::source::persisted::decode(&file) {
            let _ = mcp_xds_gateway::source::validate::decode_resources(&message.collection, &message.resources);
        }
    }

    #[test]
    fn source_files_never_panic(text in "(collection|name|version|body|struct|type_url|value_base64|labels|[-:{}\\[\\]&*!#|>, \n]|[a-z0-9/]{1,12}){0,60}") {
        let table = CollectionTable::builtin();
        let _ = mcp_xds_gateway::source::files::parse("fuzz.yaml", &text, &table);
    }

    /// Frames cut anywhere across reads, one read per piece, after the
    /// client's preface on the server side: every byte passes through, and
    /// the PINGs among them are counted once each, wherever they were cut
    /// (the 4th floods a limit of 3 a minute). PING is drawn three times as
    /// often as each other kind, so that 4 or more come up in about one case
    /// in eleven, not one in 140; `four_pings_each_cut_inside_its_header_*`
    /// reaches the flood for certain.
    #[test]
    fn the_frame_sniffer_counts_frames_split_across_reads(
        frames in prop::collection::vec(
            (prop::sample::select(vec![0x0u8, 0x1, 0x6, 0x6, 0x6, 0x7, 0x9]), any::<u8>(), any::<u32>(), prop::collection::vec(any::<u8>(), 1..40)),
            0..8,
        ),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        use mcp_xds_gateway::transport::sniff::{FloodLimits, Side, Sniffed};
        use tokio::io::AsyncReadExt;
        let mut wire = Vec::new();
        for (kind, flags, stream, payload) in &frames {
            let len = payload.len();
            wire.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, *kind, *flags]);
            wire.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
            wire.extend_from_slice(payload);
        }
        let pings = frames.iter().filter(|f| f.0 == 0x6).count();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            for side in [Side::Server, Side::Client] {
                let mut bytes = if side == Side::Server { PREFACE.to_vec() } else { Vec::new() };
                bytes.extend_from_slice(&wire);
                let limits = FloodLimits {
                    resets_per_minute: 3,
                    pings_per_minute: 3,
                    settings_per_minute: 3,
                    control_frames_per_minute: 3,
                };
                let (mut sniffed, signals) = Sniffed::new(Pieces::cut(&bytes, &cuts), side, Some(limits));
                let mut sink = Vec::new();
                sniffed.read_to_end(&mut sink).await.unwrap();
                prop_assert_eq!(&sink, &bytes);
                prop_assert_eq!(signals.flooded(), (pings > 3).then_some("pings"), "{} PINGs, {:?}", pings, side);
            }
            Ok(())
        })?;
    }

    #[test]
    fn the_frame_sniffer_never_panics(chunks in prop::collection::vec(any_bytes(), 0..8)) {
        use tokio::io::AsyncReadExt;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            for side in [mcp_xds_gateway::transport::sniff::Side::Server, mcp_xds_gateway::transport::sniff::Side::Client] {
                let mut bytes = Vec::new();
                for chunk in &chunks {
                    bytes.extend_from_slice(chunk);
                }
                let limits = mcp_xds_gateway::transport::sniff::FloodLimits {
                    resets_per_minute: 3,
                    pings_per_minute: 3,
                    settings_per_minute: 3,
                    control_frames_per_minute: 3,
                };
                let (mut sniffed, _) = mcp_xds_gateway::transport::sniff::Sniffed::new(bytes.as_slice(), side, Some(limits));
                let mut sink = Vec::new();
                sniffed.read_to_end(&mut sink).await.unwrap();
                prop_assert_eq!(sink, bytes);
            }
            Ok(())
        })?;
    }
}

/// The flood branch of the property above, for certain: PINGs each cut
/// inside its 9-byte header are counted once each, so 3 pass a limit of 3
/// a minute and the 4th floods it, on either side.
#[tokio::test]
async fn four_pings_each_cut_inside_its_header_flood_a_limit_of_three() {
    use mcp_xds_gateway::transport::sniff::{FloodLimits, Side, Sniffed};
    use tokio::io::AsyncReadExt;
    const FRAME: usize = 9 + 8;
    for pings in [3, 4] {
        for side in [Side::Server, Side::Client] {
            let mut bytes = if side == Side::Server {
                PREFACE.to_vec()
            } else {
                Vec::new()
            };
            let start = bytes.len();
            for n in 0..pings {
                bytes.extend_from_slice(&[0, 0, 8, 0x6, 0, 0, 0, 0, 0]);
                bytes.extend_from_slice(&[n as u8; 8]);
            }
            // 4 bytes into each header: its length and type in one read, its
            // flags and stream in the next.
            let cuts = (0..pings).map(|n| start + n * FRAME + 4).collect();
            let limits = FloodLimits {
                resets_per_minute: 3,
                pings_per_minute: 3,
                settings_per_minute: 3,
                control_frames_per_minute: 3,
            };
            let (mut sniffed, signals) = Sniffed::new(Pieces::at(&bytes, cuts), side, Some(limits));
            let mut sink = Vec::new();
            sniffed.read_to_end(&mut sink).await.unwrap();
            assert_eq!(sink, bytes);
            assert_eq!(
                signals.flooded(),
                (pings > 3).then_some("pings"),
                "{pings} PINGs, {side:?}"
            );
        }
    }
}

/// HTTP/2's client connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A reader that gives its bytes one piece per read.
struct Pieces(std::collections::VecDeque<Vec<u8>>);

impl Pieces {
    /// `bytes` cut at the `cuts` (empty pieces dropped: an empty read is
    /// the end).
    fn cut(bytes: &[u8], cuts: &[prop::sample::Index]) -> Self {
        Self::at(bytes, cuts.iter().map(|c| c.index(bytes.len() + 1)).collect())
    }

    /// `bytes` cut at the offsets `at`.
    fn at(bytes: &[u8], mut at: Vec<usize>) -> Self {
        at.extend([0, bytes.len()]);
        at.sort_unstable();
        at.dedup();
        Self(at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect())
    }
}

impl tokio::io::AsyncRead for Pieces {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if let Some(piece) = self.0.front_mut() {
            let n = piece.len().min(buf.remaining());
            buf.put_slice(&piece[..n]);
            piece.drain(..n);
            if piece.is_empty() {
                self.0.pop_front();
            }
        }
        std::task::Poll::Ready(Ok(()))
    }
}
