// Field paths that are not Rust: each is reported at the key string (the macro never panics on
// them), and the parameter named `r#type` is reached only as `{r#type}`.
struct Job {
    spec: (u64,),
}

#[dblock::distributed_lock(key = "job:{job.spec.4294967296}")]
async fn beyond_a_tuple_index(job: Job) -> Result<(), dblock::LockError> {
    let _ = job;
    Ok(())
}

#[dblock::distributed_lock(key = "job:{job.r#self}")]
async fn raw_self(job: Job) -> Result<(), dblock::LockError> {
    let _ = job;
    Ok(())
}

#[dblock::distributed_lock(key = "kind:{type}")]
async fn keyword(r#type: u8) -> Result<(), dblock::LockError> {
    let _ = r#type;
    Ok(())
}

fn main() {}
