//! Leader election: three instances campaign for "scheduler"; the leader runs the scheduler's
//! ticks until it resigns, and the next one takes over at once. Every instance watches
//! `lost()`, so no two ever tick at the same time.
//!
//! Runs on SQLite with no server: `cargo run --example leader`.

use std::time::Duration;

use dblock::Locker;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let path = std::env::temp_dir().join("dblock-example-leader.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let mut instances = Vec::new();
    for name in ["node-a", "node-b", "node-c"] {
        let locker = Locker::connect(&url).await?; // one per "instance"
        locker.migrate().await?;
        instances.push(tokio::spawn(async move {
            let election = locker
                .leader("scheduler")
                .holder(name)
                .ttl(Duration::from_secs(5));
            let leadership = election.campaign().await?;
            println!("{name} leads (term {})", leadership.fencing_token());
            let lost = leadership.lost();
            tokio::pin!(lost);
            for tick in 1..=3 {
                tokio::select! {
                    e = &mut lost => return Err(e),
                    () = tokio::time::sleep(Duration::from_millis(100)) => {
                        println!("  {name}: scheduler tick {tick}");
                    }
                }
            }
            println!("{name} resigns");
            leadership.resign().await
        }));
    }
    for instance in instances {
        instance.await??;
    }
    let locker = Locker::connect(&url).await?;
    let leader = locker.leader("scheduler").current().await?;
    println!(
        "\nevery instance led once; leader now: {:?}",
        leader.and_then(|l| l.holder)
    );
    Ok(())
}
