//! The first front door: [`RetryMiddleware`] in a `reqwest-middleware` chain. Each copy of a
//! request goes down the rest of the chain (`Next`) as the `reqwest::Request` it is.

use std::future::Future;
use std::pin::Pin;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use crate::driver::claim::{self, Beneath};
use crate::driver::phases::RetryMiddleware;

// Not `async_trait`, whose future would hold the request twice more and box this one inside its
// own: the logical request's future alone is boxed, and a request passed through costs none.
impl Middleware for RetryMiddleware {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<Response>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        if claim::claimed(extensions, &request) {
            // An instance further out on this request's path makes the attempts and retries.
            return next.run(request, extensions);
        }
        Box::pin(self.execute(request, extensions, next))
    }
}

impl Beneath for Next<'_> {
    #[inline]
    fn run<'s>(
        &'s self,
        request: Request,
        extensions: &'s mut Extensions,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<Response>> + Send + 's>> {
        self.clone().run(request, extensions)
    }
}
