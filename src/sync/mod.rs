//! Two small concurrency pieces every layer may use, and which import nothing of the crate:
//! [`lock`], a mutex's guard through a holder's panic, and [`OnWake`], a future polled only
//! after it has woken.

mod on_wake;

pub use on_wake::OnWake;

/// A mutex's guard, whether or not a holder panicked: every mutex in the broker guards state
/// that stays usable (a map, a counter, a cache), so a panic elsewhere must not take it along.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
