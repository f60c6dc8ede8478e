//! What crosses threads: natively, the driver's futures and what they hold are `Send` (and the
//! door beneath `Sync`), as a multi-threaded runtime needs. In the browser (`wasm32`) nothing
//! is asked of them: reqwest's answers and reqwest-middleware's chain hold the page's
//! JavaScript values there, which never leave its one thread.

use std::future::Future;
use std::pin::Pin;

/// `Send` natively; nothing in the browser.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) trait MaybeSend: Send {}
#[cfg(not(target_arch = "wasm32"))]
impl<T: Send + ?Sized> MaybeSend for T {}

/// `Send` natively; nothing in the browser.
#[cfg(target_arch = "wasm32")]
pub(crate) trait MaybeSend {}
#[cfg(target_arch = "wasm32")]
impl<T: ?Sized> MaybeSend for T {}

/// `Sync` natively; nothing in the browser.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) trait MaybeSync: Sync {}
#[cfg(not(target_arch = "wasm32"))]
impl<T: Sync + ?Sized> MaybeSync for T {}

/// `Sync` natively; nothing in the browser.
#[cfg(target_arch = "wasm32")]
pub(crate) trait MaybeSync {}
#[cfg(target_arch = "wasm32")]
impl<T: ?Sized> MaybeSync for T {}

/// A boxed future: `Send` natively, not in the browser (a trait object's extra bounds can
/// only be auto traits, so this is an alias of each kind, not `dyn Future + MaybeSend`).
#[cfg(not(target_arch = "wasm32"))]
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A boxed future: `Send` natively, not in the browser (a trait object's extra bounds can
/// only be auto traits, so this is an alias of each kind, not `dyn Future + MaybeSend`).
#[cfg(target_arch = "wasm32")]
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;
