//! gRPC streams of the gateway's sources without tonic's codec: a
//! bidirectional-streaming call from the gateway on a channel, its responses
//! read by [`RequestStream`] (each large message into a buffer of its own
//! size, freed once decoded, where tonic's decoder grows one buffer to the
//! largest message and keeps it while the stream lives: a source's whole
//! collection, for as long as it is connected; `mcp-load`'s clients read
//! the body of [`open`] with a reader of their own), and the body of
//! messages a server's side of a stream sends.

use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use http_body::Frame;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::body::Body;
use tonic::codegen::http::{self, header, HeaderMap, HeaderValue, StatusCode};
use tonic::transport::Channel;
use tonic::{Code, Status};
use tower::ServiceExt;

use super::requests::{FromBuffer, RequestBudget, RequestStream};

/// One message as a gRPC frame: uncompressed, its length, its bytes.
fn frame<M: prost::Message>(message: &M) -> Result<Frame<bytes::Bytes>, Status> {
    framed(message).map(Frame::data)
}

/// One message with its gRPC prefix: uncompressed, its length, its bytes.
pub fn framed<M: prost::Message>(message: &M) -> Result<bytes::Bytes, Status> {
    let len = message.encoded_len();
    let prefix = u32::try_from(len).map_err(|_| Status::internal(format!("a request of {len} bytes")))?;
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(prefix);
    message
        .encode(&mut buf)
        .map_err(|e| Status::internal(format!("encoding a request: {e}")))?;
    Ok(buf.freeze())
}

/// A response body of the messages `messages` yields, then trailers with an
/// OK status once it closes: a server's side of a stream.
pub fn messages_body<M: prost::Message + 'static>(messages: mpsc::Receiver<M>) -> Body {
    let mut ok = HeaderMap::new();
    ok.insert("grpc-status", HeaderValue::from_static("0"));
    let frames = ReceiverStream::new(messages)
        .map(|message| frame(&message))
        .chain(tokio_stream::once(Ok(Frame::trailers(ok))));
    Body::new(http_body_util::StreamBody::new(frames))
}

/// A compressed request stream, refused before it is read: the gateway's
/// servers read uncompressed messages only.
pub fn compressed(request: &http::Request<Body>) -> Option<Status> {
    let encoding = request.headers().get("grpc-encoding").filter(|e| *e != "identity")?;
    Some(Status::unimplemented(format!(
        "request compression {encoding:?} is not supported; send uncompressed messages"
    )))
}

/// A call of a path `service` does not serve.
pub fn not_a_method(request: &http::Request<Body>, service: &str) -> Status {
    Status::unimplemented(format!("{} is not a method of {service}", request.uri().path()))
}

/// The status of an answer that is not a gRPC stream (no `grpc-status`): as
/// gRPC maps HTTP statuses.
fn http_status(status: StatusCode) -> Status {
    let code = match status {
        StatusCode::BAD_REQUEST => Code::Internal,
        StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        StatusCode::FORBIDDEN => Code::PermissionDenied,
        StatusCode::NOT_FOUND => Code::Unimplemented,
        StatusCode::TOO_MANY_REQUESTS
        | StatusCode::BAD_GATEWAY
        | StatusCode::SERVICE_UNAVAILABLE
        | StatusCode::GATEWAY_TIMEOUT => Code::Unavailable,
        _ => Code::Unknown,
    };
    Status::new(code, format!("the answer is HTTP {status}, not a gRPC stream"))
}

/// An answered call: its response headers, the body of its messages, and
/// the status it already ended with where it was answered OK with headers
/// alone (trailers-only).
pub struct Answered {
    pub headers: HeaderMap,
    pub body: Body,
    pub ended: Option<Status>,
}

/// Opens `path` on `channel`, sending what `outbound` yields until it
/// closes. A call refused at once (a status in the headers, or an HTTP
/// error) is the error.
pub async fn open<Req: prost::Message + 'static>(
    channel: Channel,
    path: &'static str,
    outbound: mpsc::Receiver<Req>,
) -> Result<Answered, Status> {
    let frames = ReceiverStream::new(outbound).map(|request| frame(&request));
    let body = Body::new(http_body_util::StreamBody::new(frames));
    open_body(channel, path, body, HeaderMap::new()).await
}

/// [`open`] with a request body of gRPC-framed messages as it is, and
/// `metadata` sent as the call's headers.
pub async fn open_body(
    channel: Channel,
    path: &'static str,
    body: Body,
    metadata: HeaderMap,
) -> Result<Answered, Status> {
    let mut request = http::Request::new(body);
    *request.method_mut() = http::Method::POST;
    // The channel adds the scheme and authority of its endpoint.
    *request.uri_mut() = http::Uri::from_static(path);
    *request.version_mut() = http::Version::HTTP_2;
    *request.headers_mut() = metadata;
    let headers = request.headers_mut();
    headers.insert(header::TE, HeaderValue::from_static("trailers"));
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    let response = channel
        .oneshot(request)
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    let (parts, body) = response.into_parts();
    // Trailers-only: the call was answered with its status alone.
    let ended = match Status::from_header_map(&parts.headers) {
        Some(status) if status.code() != Code::Ok => return Err(status),
        Some(ok) => Some(ok),
        None if parts.status != StatusCode::OK => return Err(http_status(parts.status)),
        None => None,
    };
    Ok(Answered {
        headers: parts.headers,
        body,
        ended,
    })
}

/// [`open`], its responses read by [`RequestStream`] as messages `Resp`.
pub async fn bidi<Req, Resp>(
    channel: Channel,
    path: &'static str,
    outbound: mpsc::Receiver<Req>,
    budget: Arc<RequestBudget>,
    message: &'static str,
) -> Result<(HeaderMap, RequestStream<Resp>), Status>
where
    Req: prost::Message + 'static,
    Resp: FromBuffer,
{
    let Answered { headers, body, ended } = open(channel, path, outbound).await?;
    let stream = RequestStream::new(body, budget, message);
    let stream = match ended {
        Some(ok) => stream.ended_with(ok),
        None => stream,
    };
    Ok((headers, stream))
}
