//! The one way dblock takes a std mutex.

use std::sync::{Mutex, MutexGuard};

/// The mutex's guard, also after a panic elsewhere while it was held: every critical section in
/// dblock leaves its data whole at each step (no invariant spans a panic point), so a poisoned
/// lock carries nothing half-done, and a lock library must not turn one panic into many.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
