//! The test database's clock: `julianday('now')` read from the tokio runtime's clock.
//!
//! dblock's SQLite statements read the time only as `julianday('now')`. On the test database's
//! connection that one-argument function is replaced by one that returns the runtime's time
//! (paused or not) on the same scale: the wall-clock time when the locker was made, plus what
//! the runtime's clock has moved since. Any other argument is an error, so nothing can read a
//! date from it silently wrong.
//!
//! This is the crate's one use of `unsafe`: sqlx has no safe way to register an SQL function,
//! so it goes through SQLite's C API (`sqlite3_create_function_v2`) on the connection's raw
//! handle, while sqlx's worker holds that connection locked for us.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use libsqlite3_sys as ffi;
use tokio::runtime::Handle;
use tokio::time::Instant;

/// The Julian day of the Unix epoch, and milliseconds a day.
const EPOCH_JULIAN_DAY: f64 = 2_440_587.5;
const MS_PER_DAY: f64 = 86_400_000.0;

/// The runtime whose clock the database reads, and where that clock and the wall clock stood
/// together.
#[derive(Clone, Debug)]
pub(super) struct Clock(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    rt: Handle,
    start: Instant,
    start_unix_ms: f64,
}

impl Clock {
    /// The clock of the current runtime (the caller is on one: `locker()` checked it).
    pub(super) fn here() -> Clock {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Clock(Arc::new(Inner {
            rt: Handle::current(),
            start: Instant::now(),
            start_unix_ms: unix.as_secs_f64() * 1000.0,
        }))
    }

    /// Makes `julianday('now')` on `conn` read this clock.
    pub(super) async fn install(
        &self,
        conn: &mut sqlx::SqliteConnection,
    ) -> Result<(), sqlx::Error> {
        let mut locked = conn.lock_handle().await?;
        register(locked.as_raw_handle(), self.0.clone())
    }
}

impl Inner {
    /// Now as a Julian day. Called on sqlx's worker thread: it enters the runtime to read its
    /// clock, which a paused runtime keeps for every thread that enters it.
    fn julian_day(&self) -> f64 {
        let _in = self.rt.enter();
        let since = Instant::now().saturating_duration_since(self.start);
        EPOCH_JULIAN_DAY + (self.start_unix_ms + since.as_secs_f64() * 1000.0) / MS_PER_DAY
    }
}

fn register(db: NonNull<ffi::sqlite3>, clock: Arc<Inner>) -> Result<(), sqlx::Error> {
    let data = Arc::into_raw(clock).cast_mut().cast::<c_void>();
    // SAFETY: `db` is a live connection that sqlx's worker keeps locked for this call
    // (`LockedSqliteHandle`); the name is a NUL-terminated literal; `data` is one strong count
    // of an `Arc<Inner>`, handed to SQLite, which gives it back to `release` once, when the
    // function is replaced or the connection closes — also when registration fails.
    let rc = unsafe {
        ffi::sqlite3_create_function_v2(
            db.as_ptr(),
            c"julianday".as_ptr(),
            1,
            ffi::SQLITE_UTF8,
            data,
            Some(julianday),
            None,
            None,
            Some(release),
        )
    };
    if rc == ffi::SQLITE_OK {
        Ok(())
    } else {
        Err(sqlx::Error::Protocol(format!(
            "dblock::testing: could not install the test clock (SQLite error {rc})"
        )))
    }
}

/// `julianday(x)`: the runtime's now for `'now'`, an error for anything else.
unsafe extern "C" fn julianday(
    ctx: *mut ffi::sqlite3_context,
    argc: c_int,
    argv: *mut *mut ffi::sqlite3_value,
) {
    // SAFETY: SQLite calls this with its context and `argc` arguments; the user data is the
    // `Arc<Inner>` given at registration, alive until `release`, which SQLite does not call
    // while the function runs. `sqlite3_value_text` returns NULL or a NUL-terminated string
    // valid until the value changes, which it does not before this function returns.
    unsafe {
        let now = argc == 1 && {
            let text = ffi::sqlite3_value_text(*argv);
            !text.is_null() && CStr::from_ptr(text.cast()).to_bytes() == b"now"
        };
        if !now {
            ffi::sqlite3_result_error(
                ctx,
                c"julianday(): the test database of dblock::testing knows only 'now'".as_ptr(),
                -1,
            );
            return;
        }
        let clock = &*ffi::sqlite3_user_data(ctx).cast::<Inner>();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| clock.julian_day())) {
            Ok(day) => ffi::sqlite3_result_double(ctx, day),
            Err(_) => ffi::sqlite3_result_error(
                ctx,
                c"dblock::testing: the runtime's clock could not be read".as_ptr(),
                -1,
            ),
        }
    }
}

/// Gives back the strong count that registration handed to SQLite.
unsafe extern "C" fn release(data: *mut c_void) {
    // SAFETY: `data` came from `Arc::into_raw` in `register`, and SQLite calls this once.
    drop(unsafe { Arc::from_raw(data.cast_const().cast::<Inner>()) });
}
