//! The future of a copy on its way to the inner service.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tower_service::Service;

use super::error::BoxError;
use crate::driver::retry_body::RetryBody;

pin_project_lite::pin_project! {
    /// A copy on its way to the inner service: its call, or, while the service is not ready,
    /// the service asked again with the copy waiting (boxed: rare), or the error that the
    /// service gave when asked.
    #[project = CallNow]
    pub(crate) enum Call<S, Q, F> {
        Called {
            #[pin]
            call: F,
        },
        Waiting {
            waiting: Box<(S, Option<Q>)>,
        },
        Failed {
            error: Option<BoxError>,
        },
    }
}

impl<S, Q, R> Future for Call<S, Q, S::Future>
where
    S: Service<Q, Response = http::Response<R>>,
    S::Error: Into<BoxError>,
{
    type Output = Result<http::Response<RetryBody<R>>, BoxError>;

    /// The inner service's answer, its body passed on as it comes, or its error, boxed.
    /// Turns at most twice: asked until ready, then called.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let call = match self.as_mut().project() {
                CallNow::Called { call } => {
                    let answer = std::task::ready!(call.poll(cx));
                    return Poll::Ready(match answer {
                        Ok(response) => Ok(response.map(RetryBody::inner)),
                        Err(e) => Err(e.into()),
                    });
                }
                CallNow::Failed { error } => {
                    let Some(error) = error.take() else {
                        panic!("a copy's call was polled after it ended");
                    };
                    return Poll::Ready(Err(error));
                }
                CallNow::Waiting { waiting } => {
                    let (service, request) = &mut **waiting;
                    if let Err(e) = std::task::ready!(service.poll_ready(cx)) {
                        return Poll::Ready(Err(e.into()));
                    }
                    let Some(request) = request.take() else {
                        unreachable!("a waiting copy is called once, as it stops waiting");
                    };
                    service.call(request)
                }
            };
            self.set(Call::Called { call });
        }
    }
}
