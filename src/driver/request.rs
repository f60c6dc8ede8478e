//! What one logical request keeps of itself while its attempts go: the request its copies are
//! made from (`Kept`), what was decided of it before its first attempt (`Sent`: its key, whether
//! it may be repeated, what the classifier and the observer see of it), and what its end needs
//! (`Ends`).

use http::Extensions;
use url::Url;

use crate::driver::body::{Outcome, Reply};
use crate::driver::claim::{self, Outgoing};
use crate::driver::trace::Watcher;
use crate::engine::attempt_headers::AttemptHeaders;
use crate::engine::classifier::{Classifier, RequestHead};
use crate::engine::classify::{self, Judging};
use crate::engine::decide::{Facts, Plan};
use crate::engine::dependency::Dependency;
use crate::engine::idempotency::{self, IdempotencyKeys, Key, NaturalKey};
use crate::engine::policy::RetryPolicy;
use crate::engine::rules::Rules;
use crate::engine::seen::{Locate, Seen, Target};
use crate::error::{InvalidConfig, LastError, NotSent};
use crate::fault::Fault;
use crate::observe::Observer;
use crate::shared::Shared;
use crate::stop::StopReason;

/// The last outcome of a request, with the transient fault its door found in it.
pub(crate) type Last<R> = (Outcome<R>, Option<Fault>);

/// What a request's end needs of it besides its outcome: its key (and whether it was sent
/// before the last attempt), who watches, and where its URL is found, for an error.
pub(crate) struct Ends<'s, 'a> {
    pub(crate) key: Option<(Key, bool)>,
    pub(crate) watcher: Option<&'s Watcher<'a>>,
    pub(crate) url: &'s dyn KeptUrl,
    /// What a first attempt's answer stands for without a record (the door's `answered`).
    pub(crate) answered: StopReason,
}

/// Where a request's URL is found after it has gone: asked only for an error.
pub(crate) trait KeptUrl {
    /// The request's URL, kept or gone.
    fn url(&self) -> Option<Url>;
}

/// What the request keeps between attempts: the original while another copy of it may be
/// sent, its URL once the original itself went (for an error that has none), and the last
/// outcome through the wait after it.
pub(crate) struct Kept<Q: Outgoing, R: Reply> {
    request: Option<Q>,
    /// Where the original went, once it went itself (boxed, as only a last attempt needs it).
    gone: Option<Box<Q::Gone>>,
    /// Kept for a stop that may follow the wait (boxed: only a retry needs room for it), and
    /// let go when the next attempt is sent.
    pub(crate) previous: Option<Box<Last<R>>>,
}

impl<Q: Outgoing, R: Reply> Kept<Q, R> {
    pub(crate) fn new(request: Q) -> Kept<Q, R> {
        Kept {
            request: Some(request),
            gone: None,
            previous: None,
        }
    }

    /// What a stop before an attempt hands back: the last outcome, or what says nothing was sent.
    pub(crate) fn last_outcome(&mut self, stop: StopReason) -> Last<R> {
        self.previous.take().map_or_else(
            || (Err(LastError::NotSent(NotSent::new(stop))), None),
            |last| *last,
        )
    }

    /// The request, before its first attempt.
    pub(crate) fn request(&self) -> &Q {
        let Some(request) = &self.request else {
            unreachable!("the request is kept until its first attempt");
        };
        request
    }

    /// Where the request goes: the request kept, or what was kept of it once it went itself.
    pub(crate) fn went_to(&self) -> &dyn Locate {
        match (&self.request, &self.gone) {
            (Some(request), _) => request.locate(),
            (None, Some(gone)) => &**gone,
            (None, None) => unreachable!("what went of a request is kept when it goes"),
        }
    }

    /// Where a copy of the request would go, when one is at hand for another attempt.
    pub(crate) fn resend(&self) -> Option<&dyn Locate> {
        self.request.as_ref().map(Q::locate)
    }

    /// The request for a copy: a clone when `keep` (the original stays kept), else the original
    /// itself, and the original too when it cannot be cloned (a stream: nothing is then kept).
    #[inline]
    fn take(&mut self, keep: bool) -> Q {
        self.previous = None;
        if let Some(copy) = self
            .request
            .as_mut()
            .filter(|_| keep)
            .and_then(Q::copy_to_send)
        {
            return copy;
        }
        let Some(original) = self.request.take() else {
            unreachable!("a request is kept for every copy that is sent");
        };
        self.gone = Some(Box::new(original.gone()));
        original
    }
}

impl<Q: Outgoing, R: Reply> KeptUrl for Kept<Q, R> {
    fn url(&self) -> Option<Url> {
        match (&self.request, &self.gone) {
            (Some(request), _) => Q::url_of(&request.gone()),
            (None, Some(gone)) => Q::url_of(gone),
            (None, None) => None,
        }
    }
}

/// Where a URL points, as the engine reads it: only when a rule asks (a quota to look up, a
/// route to match).
impl Locate for Url {
    fn target(&self) -> Target<'_> {
        Target::new(self.scheme(), self.host_str().unwrap_or(""), self.port())
    }
}

/// What a classifier sees of `request` after it has gone: its method, its URL as a URI (no
/// fragment: a URI a request carries has none), and its headers.
fn head_of(request: &impl Outgoing) -> RequestHead {
    RequestHead {
        method: request.method().clone(),
        uri: request.uri(),
        headers: request.headers().clone(),
    }
}

/// What one logical request keeps of itself while its attempts go, decided before the first.
pub(crate) struct Sent<'a> {
    pub(crate) key: Option<Key>,
    /// The key has been sent: a caller's own or a derived one (perhaps by an earlier run), or
    /// a new one once an attempt may have reached the server.
    key_sent: bool,
    /// The key had been sent before the attempt whose outcome was last taken in: only then
    /// does a server's `Idempotent-Replayed` on its answer mean a replay.
    answered_under_sent_key: bool,
    /// The method is idempotent, or the request carries a key.
    repeatable: bool,
    /// The dependency's keys and attempt headers, for each copy.
    keys: Option<&'a IdempotencyKeys>,
    headers: &'a AttemptHeaders,
    /// The dependency's classifier, and the request's head for it to see.
    head: Option<(&'a Shared<dyn Classifier>, Box<RequestHead>)>,
    pub(crate) watcher: Option<Box<Watcher<'a>>>,
    /// The request's fingerprint, by which an instance behind the other door knows it.
    pub(crate) print: u64,
}

/// A request stopped before its first attempt: why, the error that says so, and who watches.
pub(crate) struct Unsent<'a> {
    pub(crate) stop: StopReason,
    pub(crate) cause: NotSent,
    pub(crate) watcher: Option<Box<Watcher<'a>>>,
}

impl<'a> Sent<'a> {
    /// What a request needs after it has gone, and what the core needs to know of it: its key,
    /// whether it may be repeated or hedged, and what the classifier and the observer see of
    /// it. `refused` is why it may not go at all (an invalid override).
    #[inline(always)]
    pub(crate) fn prepare(
        dependency: &'a Dependency,
        observer: Option<&'a dyn Observer>,
        watched: bool,
        (request, extensions): (&impl Outgoing, &Extensions),
        refused: Option<InvalidConfig>,
    ) -> Result<(Sent<'a>, Facts), Unsent<'a>> {
        // Only when someone watches is the request's name (method, host, path) copied.
        let watcher = watched.then(|| Box::new(Watcher::of(observer, &dependency.name, request)));
        if let Some(refused) = refused {
            let stop = StopReason::InvalidOverride;
            return Err(Unsent {
                stop,
                cause: NotSent::because(stop, refused),
                watcher,
            });
        }
        let key = match idempotency::key_for(
            dependency.keys.as_ref(),
            request.method(),
            request.headers(),
            extensions.get::<NaturalKey>(),
        ) {
            Ok(key) => key,
            Err(e) => {
                let stop = StopReason::InvalidIdempotencyKey;
                return Err(Unsent {
                    stop,
                    cause: NotSent::because(stop, e),
                    watcher,
                });
            }
        };
        let whole_body = request.whole_body();
        let facts = Facts {
            stamped: key.as_ref().is_some_and(|key| key.stamped),
            hedgeable: classify::may_be_hedged(request.method(), key.is_some(), whole_body),
        };
        let sent = Sent {
            repeatable: key.is_some() || classify::is_idempotent(request.method()),
            key_sent: key.as_ref().is_some_and(|key| !key.fresh),
            answered_under_sent_key: false,
            key,
            keys: dependency.keys.as_ref(),
            headers: &dependency.attempt_headers,
            // Only a classifier needs the request after it has gone: its head is kept for it.
            head: (dependency.classifier.as_ref()).map(|c| (c, Box::new(head_of(request)))),
            watcher,
            print: claim::fingerprint(request),
        };
        Ok((sent, facts))
    }

    /// The copy of the request that `plan` sends: the one place where a copy gets the key and
    /// the attempt headers (the dependency's, and its `rules`' own), each computed for this
    /// copy.
    #[inline]
    pub(crate) fn copy<Q: Outgoing, R: Reply>(
        &self,
        kept: &mut Kept<Q, R>,
        plan: &Plan,
        rules: &dyn Rules,
    ) -> Q {
        let mut sending = kept.take(plan.keep_copy);
        idempotency::put_on(self.keys, self.key.as_ref(), sending.headers_mut());
        if self.headers.are_on() {
            (self.headers).put_on(sending.headers_mut(), plan.number, plan.left);
        }
        rules.attempt_headers(sending.headers_mut(), plan.number, plan.left);
        sending
    }

    /// What the request's end needs, with what it `kept`.
    pub(crate) fn ends<'s, Q: Outgoing, R: Reply>(
        &'s mut self,
        kept: &'s Kept<Q, R>,
    ) -> Ends<'s, 'a> {
        let key = self
            .key
            .take()
            .map(|key| (key, self.answered_under_sent_key));
        Ends {
            key,
            watcher: self.watcher.as_deref(),
            url: kept,
            answered: StopReason::Succeeded,
        }
    }

    /// How this request's outcomes are judged under `policy`.
    #[inline]
    pub(crate) fn judging<'j>(&'j self, policy: &'j RetryPolicy) -> Judging<'j> {
        Judging {
            policy,
            repeatable: self.repeatable,
            key: self.key.as_ref().map(|key| &key.value),
            key_sent: self.key_sent,
            hook: self.head.as_ref().map(|(c, head)| (*c, &**head)),
        }
    }

    /// Takes in an attempt's outcome, `seen`: its key has been sent if the attempt may have
    /// reached the server.
    #[inline]
    pub(crate) fn took(&mut self, seen: &Seen<'_>) {
        self.answered_under_sent_key = self.key_sent;
        if self.key.is_some() && !self.key_sent {
            self.key_sent = seen.may_have_reached();
        }
    }
}
