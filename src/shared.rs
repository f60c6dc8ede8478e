//! A user's hook as the middleware stores it: shared by every request and every clone, with a
//! `Debug` that names the trait instead of asking one of the user's type.

use std::fmt;
use std::sync::Arc;

/// What a shared hook's `Debug` prints.
pub(crate) trait Named {
    const NAME: &'static str;
}

/// A hook of the user's, behind an `Arc`.
pub(crate) struct Shared<T: ?Sized>(pub(crate) Arc<T>);

impl<T: ?Sized> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(Arc::clone(&self.0))
    }
}

impl<T: ?Sized + Named> fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(T::NAME)
    }
}
