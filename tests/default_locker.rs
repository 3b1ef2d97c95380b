//! `#[distributed_lock]` without `locker =` uses the process default: `NoLocker` before
//! `dblock::set_default`, the set locker after. One test in its own binary, since the default is
//! process-wide.

use dblock::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "report:{day}")]
async fn report(day: &str) -> Result<String, LockError> {
    Ok(dblock::current().unwrap().key)
}

#[tokio::test]
async fn the_default_locker_is_used_once_set() {
    assert!(matches!(report("mon").await, Err(LockError::NoLocker)));
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("d.db").display());
    let locker = Locker::connect(&url).await.unwrap();
    locker.migrate().await.unwrap();
    dblock::set_default(locker.clone());
    assert_eq!(report("tue").await.unwrap(), "report:tue");
    assert!(
        locker.inspect("report:tue").await.unwrap().is_some(),
        "the default locker's table was used"
    );
    let held = locker.lock("report:wed").await.unwrap();
    assert!(matches!(report("wed").await, Err(LockError::Busy { .. })));
    held.release().await.unwrap();
}
