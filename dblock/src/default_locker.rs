//! The process-wide default [`Locker`], used by `#[distributed_lock]` without `locker = ...`.

use std::sync::RwLock;

use crate::error::LockError;
use crate::locker::Locker;

static DEFAULT: RwLock<Option<Locker>> = RwLock::new(None);

#[cfg(feature = "testing")]
tokio::task_local! {
    /// The locker `dblock::testing::with_default` gives the task it runs.
    static SCOPED: Locker;
}

/// Runs `fut` with `locker` as its task's default (`dblock::testing::with_default`).
#[cfg(feature = "testing")]
pub(crate) fn scoped<F: std::future::Future>(
    locker: Locker,
    fut: F,
) -> impl std::future::Future<Output = F::Output> {
    SCOPED.scope(locker, fut)
}

/// Sets the process-wide default locker (replacing any earlier one).
///
#[cfg_attr(feature = "sqlite", doc = "```")]
#[cfg_attr(not(feature = "sqlite"), doc = "```no_run")]
/// # async fn demo() -> Result<(), dblock::LockError> {
/// let locker = dblock::Locker::connect("sqlite::memory:").await?;
/// dblock::set_default(locker);
/// assert!(dblock::default_locker().is_ok());
/// # Ok(()) }
/// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
/// ```
pub fn set_default(locker: Locker) {
    let mut slot = DEFAULT
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    *slot = Some(locker);
}

/// The locker given to [`set_default`], or [`LockError::NoLocker`]. (Inside
/// `dblock::testing::with_default`, feature `testing`, the locker given to it.)
///
/// ```
/// // before any set_default:
/// # if false {
/// assert!(matches!(dblock::default_locker(), Err(dblock::LockError::NoLocker)));
/// # }
/// ```
pub fn default_locker() -> Result<Locker, LockError> {
    #[cfg(feature = "testing")]
    if let Ok(locker) = SCOPED.try_with(Locker::clone) {
        return Ok(locker);
    }
    DEFAULT
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()
        .ok_or(LockError::NoLocker)
}
