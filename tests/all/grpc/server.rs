//! A real tonic server on 127.0.0.1, scripted call by call, and a client as tonic's generated
//! code writes one. The message is written by hand as prost derives it: no protoc.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use tonic::{Code, Status};

/// `echo.Echo`'s one message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Echo {
    #[prost(string, tag = "1")]
    pub text: String,
}

/// What the server does with a call, in order; once the script is done, it answers.
#[derive(Debug, Clone)]
pub enum Act {
    /// A trailers-only failure: this code, with this `grpc-retry-pushback-ms` if any.
    Fail(Code, Option<&'static str>),
    /// An answer after this long (real time).
    Slow(Duration),
    /// For a stream: one message, then this failure in the trailers (the call committed).
    SendThenFail(Code),
    /// Held until `Gate` opens, then the answer (`None`) or this failure, with this
    /// pushback if any; a call held when its client cancels it is counted as cancelled.
    Held(Gate, Option<(Code, Option<&'static str>)>),
}

/// What holds a call until the test opens it; one that is never opened holds it for ever.
pub type Gate = Arc<tokio::sync::Notify>;

/// Counts a call cancelled: its handler dropped before it answered.
struct Cancel(Option<Arc<std::sync::atomic::AtomicUsize>>);

impl Drop for Cancel {
    fn drop(&mut self) {
        if let Some(count) = self.0.take() {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The scripted server: what it was told to do, and the head of every call it got.
#[derive(Clone, Default)]
pub struct Script {
    acts: Arc<Mutex<VecDeque<Act>>>,
    seen: Arc<Mutex<Vec<http::HeaderMap>>>,
    cancelled: Arc<std::sync::atomic::AtomicUsize>,
}

impl Script {
    pub fn new(acts: impl IntoIterator<Item = Act>) -> Script {
        Script {
            acts: Arc::new(Mutex::new(acts.into_iter().collect())),
            seen: Arc::default(),
            cancelled: Arc::default(),
        }
    }

    /// Calls the client cancelled while the server held them.
    pub fn cancelled(&self) -> usize {
        self.cancelled.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until `what` holds of the script, in real time, for at most two seconds: for
    /// what a server on another task has done by then.
    pub async fn until(&self, what: impl Fn(&Script) -> bool) {
        for _ in 0..400 {
            if what(self) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the server never got there");
    }

    /// The heads of the calls the server got, in order.
    pub fn seen(&self) -> Vec<http::HeaderMap> {
        self.seen.lock().unwrap().clone()
    }

    /// The values of `name` on every call, in order (`None` where absent).
    pub fn values(&self, name: &str) -> Vec<Option<String>> {
        let seen = self.seen();
        let value = |h: &http::HeaderMap| h.get(name).map(|v| v.to_str().unwrap().to_owned());
        seen.iter().map(value).collect()
    }

    fn next(&self) -> Option<Act> {
        self.acts.lock().unwrap().pop_front()
    }
}

fn failure(code: Code, pushback: Option<&'static str>) -> Status {
    let mut status = Status::new(code, "scripted");
    if let Some(ms) = pushback {
        status
            .metadata_mut()
            .insert("grpc-retry-pushback-ms", ms.parse().unwrap());
    }
    status
}

#[derive(Clone)]
struct EchoServer(Script);

impl tower_service::Service<http::Request<tonic::body::Body>> for EchoServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Boxed<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let script = self.0.clone();
        Box::pin(async move {
            script.seen.lock().unwrap().push(request.headers().clone());
            let codec = tonic_prost::ProstCodec::<Echo, Echo>::default();
            let mut grpc = tonic::server::Grpc::new(codec);
            Ok(match request.uri().path() {
                "/echo.Echo/Say" => grpc.unary(Say(script), request).await,
                "/echo.Echo/Count" => grpc.server_streaming(Count(script), request).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Say(Script);

impl tonic::server::UnaryService<Echo> for Say {
    type Response = Echo;
    type Future = Boxed<Result<tonic::Response<Echo>, Status>>;

    fn call(&mut self, request: tonic::Request<Echo>) -> Self::Future {
        let act = self.0.next();
        let cancelled = self.0.cancelled.clone();
        Box::pin(async move {
            match act {
                Some(Act::Fail(code, pushback)) => return Err(failure(code, pushback)),
                Some(Act::Slow(after)) => tokio::time::sleep(after).await,
                Some(Act::SendThenFail(code)) => return Err(failure(code, None)),
                Some(Act::Held(gate, then)) => {
                    let mut cancel = Cancel(Some(cancelled));
                    gate.notified().await;
                    cancel.0 = None;
                    if let Some((code, pushback)) = then {
                        return Err(failure(code, pushback));
                    }
                }
                None => {}
            }
            Ok(tonic::Response::new(request.into_inner()))
        })
    }
}

struct Count(Script);

type Messages = Pin<Box<dyn tokio_stream::Stream<Item = Result<Echo, Status>> + Send>>;

impl tonic::server::ServerStreamingService<Echo> for Count {
    type Response = Echo;
    type ResponseStream = Messages;
    type Future = Boxed<Result<tonic::Response<Messages>, Status>>;

    fn call(&mut self, request: tonic::Request<Echo>) -> Self::Future {
        let act = self.0.next();
        Box::pin(async move {
            let echo = request.into_inner();
            let stream: Messages = match act {
                Some(Act::Fail(code, pushback)) => return Err(failure(code, pushback)),
                Some(Act::SendThenFail(code)) => {
                    Box::pin(tokio_stream::iter([Ok(echo), Err(failure(code, None))]))
                }
                _ => Box::pin(tokio_stream::iter([Ok(echo.clone()), Ok(echo)])),
            };
            Ok(tonic::Response::new(stream))
        })
    }
}

/// A tonic server for `script` on 127.0.0.1, and its address's URI.
pub async fn serve(script: &Script) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let service = EchoServer(script.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .serve_with_incoming(service, incoming)
            .await
            .unwrap();
    });
    format!("http://{address}")
}

/// A lazy channel to `uri`.
pub fn channel(uri: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(uri.to_owned())
        .unwrap()
        .connect_lazy()
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Calls `/echo.Echo/Say` through `service` as a generated client does.
pub async fn say<S>(
    service: S,
    request: tonic::Request<Echo>,
) -> Result<tonic::Response<Echo>, Status>
where
    S: tonic::client::GrpcService<tonic::body::Body>,
    S::Error: Into<BoxError>,
    S::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<BoxError>,
{
    let mut grpc = tonic::client::Grpc::new(service);
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(e.into().to_string()))?;
    let path = PathAndQuery::from_static("/echo.Echo/Say");
    grpc.unary(request, path, tonic_prost::ProstCodec::default())
        .await
}

/// Calls `/echo.Echo/Count` and reads its stream: the messages, then how it ended.
pub async fn count<S>(service: S, text: &str) -> (Vec<String>, Result<(), Status>)
where
    S: tonic::client::GrpcService<tonic::body::Body>,
    S::Error: Into<BoxError>,
    S::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<BoxError>,
{
    let mut grpc = tonic::client::Grpc::new(service);
    if let Err(e) = grpc.ready().await {
        return (Vec::new(), Err(Status::unknown(e.into().to_string())));
    }
    let path = PathAndQuery::from_static("/echo.Echo/Count");
    let request = tonic::Request::new(Echo { text: text.into() });
    let codec = tonic_prost::ProstCodec::<Echo, Echo>::default();
    let mut stream = match grpc.server_streaming(request, path, codec).await {
        Ok(response) => response.into_inner(),
        Err(status) => return (Vec::new(), Err(status)),
    };
    let mut got = Vec::new();
    // Bounded: the server sends at most two messages.
    for _ in 0..4 {
        match stream.message().await {
            Ok(Some(echo)) => got.push(echo.text),
            Ok(None) => return (got, Ok(())),
            Err(status) => return (got, Err(status)),
        }
    }
    (got, Ok(()))
}

/// A request to say `text`.
pub fn text(text: &str) -> tonic::Request<Echo> {
    tonic::Request::new(Echo { text: text.into() })
}
