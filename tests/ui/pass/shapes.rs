//! Every function shape the attribute must accept, with signatures, docs and attributes intact.
#![deny(warnings)]

use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use dblock::{distributed_lock, LockError, Locker};

#[derive(Debug)]
pub struct AppError;

impl From<LockError> for AppError {
    fn from(_: LockError) -> Self {
        AppError
    }
}

/// A free function; its docs survive.
#[distributed_lock(key = "order:{order_id}", ttl = "30s", wait = "5s")]
#[must_use = "check the outcome"]
pub async fn free(order_id: u64, amount: u32) -> Result<u64, AppError> {
    Ok(order_id + u64::from(amount))
}

#[distributed_lock(key = "plain")]
async fn no_params() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "anyhow:{n}")]
async fn with_anyhow(n: i32) -> anyhow::Result<i32> {
    let parsed: i32 = "5".parse()?;
    Ok(n + parsed)
}

#[distributed_lock(key = "boxed")]
async fn boxed_error() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    Err("nope")?;
    Ok(())
}

pub struct Service {
    locks: Locker,
    tenant: String,
    hits: u32,
}

impl Service {
    #[distributed_lock(key = "{self.tenant}:a", locker = self.locks)]
    async fn by_ref(&self) -> Result<usize, LockError> {
        Ok(self.tenant.len())
    }

    #[distributed_lock(key = "{self.tenant}:b", locker = self.locks, renew = false)]
    async fn by_mut(&mut self, by: u32) -> Result<u32, LockError> {
        self.hits += by;
        Ok(self.hits)
    }

    #[distributed_lock(key = "{self.tenant}:c", locker = &self.locks)]
    async fn by_value(self) -> Result<String, LockError> {
        Ok(self.tenant)
    }

    #[distributed_lock(key = "{self.tenant}:d", locker = self.locks)]
    async fn by_arc(self: Arc<Self>) -> Result<u32, LockError> {
        Ok(self.hits)
    }

    #[distributed_lock(key = "static:{x}")]
    async fn associated(x: u8) -> Result<u8, LockError> {
        Ok(x)
    }
}

trait Settle {
    async fn settle(&self, id: u64) -> Result<u64, AppError>;
}

impl Settle for Service {
    #[distributed_lock(key = "trait:{id}", locker = self.locks)]
    async fn settle(&self, id: u64) -> Result<u64, AppError> {
        Ok(id)
    }
}

#[distributed_lock(key = "generic:{label}:{item}")]
async fn generic<'a, T, U: Display>(label: &'a str, item: T, other: U) -> Result<String, LockError>
where
    T: Display + Send + 'a,
{
    Ok(format!("{label}{item}{other}"))
}

#[distributed_lock(key = "impl:{name}")]
async fn impl_trait(name: impl Display + Send, values: impl IntoIterator<Item = u32>) -> Result<u32, LockError> {
    let _ = name.to_string();
    Ok(values.into_iter().sum())
}

#[distributed_lock(key = "impl-out")]
async fn impl_in_return() -> Result<impl Display, LockError> {
    Ok(1u8)
}

#[distributed_lock(key = "impl-nested")]
async fn impl_nested_in_return() -> Result<(impl Display, Vec<(u8, impl Display)>), LockError> {
    Ok(("a", vec![(1, 2u16)]))
}

pub struct Point {
    pub x: i64,
    pub y: i64,
}

#[distributed_lock(key = "pt:{x}:{y}:{a}:{b}")]
async fn patterns(Point { x, y }: Point, (a, mut b): (u8, u8), mut count: u32) -> Result<i64, LockError> {
    b += 1;
    count += u32::from(b);
    Ok(x + y + i64::from(a) + i64::from(count))
}

#[distributed_lock(key = format!("computed-{}", 1 + 1), ttl = Duration::from_millis(1500), wait = Duration::ZERO, renew = 1 > 0)]
async fn expressions() -> Result<(), LockError> {
    Ok(())
}

/// Option values may `.await` and use `?`: they are worked out in the function, as the key is.
async fn configured_ttl() -> Duration {
    Duration::from_secs(20)
}

fn parsed(text: &str) -> Result<Duration, AppError> {
    text.parse().map(Duration::from_millis).map_err(|_| AppError)
}

#[distributed_lock(key = "configured", ttl = configured_ttl().await, wait = parsed("250")?, max_hold = parsed("60000")?, once = configured_ttl().await > Duration::ZERO, fair = parsed("1")? > Duration::ZERO, renew = configured_ttl().await.as_secs() > 1)]
async fn awaited_options() -> Result<(), AppError> {
    Ok(())
}

#[distributed_lock(key = "exports", permits = u32::try_from(configured_ttl().await.as_secs()).map_err(|_| AppError)?, lock_delay = parsed("5")?)]
async fn awaited_permits() -> Result<(), AppError> {
    Ok(())
}

#[distributed_lock(key = "pair:{pair.0}:{pair.1}")]
async fn tuple_fields(pair: (u8, &'static str)) -> Result<(), LockError> {
    let _ = pair;
    Ok(())
}

mod renamed {
    pub use dblock as locks;
}

#[distributed_lock(key = "renamed", crate = renamed::locks)]
async fn renamed_crate() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "renamed-str", crate = "renamed::locks")]
async fn renamed_crate_str() -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "r#type:{r#type}")]
async fn raw_ident(r#type: u8) -> Result<u8, LockError> {
    Ok(r#type)
}

/// Work that runs once, on a schedule.
#[distributed_lock(key = "nightly:{day}", min_hold = "50m", once = true)]
async fn scheduled_once(day: u32) -> Result<(), LockError> {
    let _ = day;
    Ok(())
}

#[distributed_lock(key = "maybe", once = std::env::var("ONCE").is_ok(), min_hold = Duration::from_secs(1))]
async fn once_by_expression() -> Result<(), LockError> {
    Ok(())
}

fn main() {
    // Only the types matter here; behaviour is tested against real databases elsewhere.
    let _ = free(1, 2);
    let _ = no_params();
    let _ = with_anyhow(1);
    let _ = boxed_error();
    let _ = generic("a", 1, 2.5);
    let _ = impl_trait("n", vec![1, 2]);
    let _ = impl_in_return();
    let _ = impl_nested_in_return();
    let _ = patterns(Point { x: 1, y: 2 }, (3, 4), 5);
    let _ = expressions();
    let _ = tuple_fields((1, "a"));
    let _ = renamed_crate();
    let _ = renamed_crate_str();
    let _ = raw_ident(1);
    let _ = scheduled_once(1);
    let _ = once_by_expression();
    let _ = Service::associated(1);
    let _ = |s: Service, a: Arc<Service>, m: &mut Service| {
        let _ = s.by_ref();
        let _ = m.by_mut(1);
        let _ = a.by_arc();
        let _ = Settle::settle(&*m, 1);
    };
    let _ = |s: Service| s.by_value();
}

/// `reentrant` takes any `bool` expression, also with a list of keys.
#[distributed_lock(key = ["left:{id}", "right:{id}"], reentrant = id > 10, wait = "1s")]
async fn not_reentrant_pair(id: u32) -> Result<(), LockError> {
    let _ = id;
    Ok(())
}

/// With `permits`, `reentrant = false` gives each call a permit of its own.
#[distributed_lock(key = "exports", permits = 3, reentrant = false)]
async fn a_permit_each() -> Result<(), LockError> {
    Ok(())
}
