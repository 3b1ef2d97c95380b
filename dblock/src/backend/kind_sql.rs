//! Statement texts that belong to one kind of lock (shared locks' today), built from the table's
//! name the first time that kind runs on the table. Each backend's type holds one [`KindSqls`]
//! and names no kind: a new kind brings its texts in its own files (`backend/<db>/<kind>.rs`,
//! implementing [`KindSql`]) and touches no backend constructor.

use std::any::Any;
use std::sync::{Arc, Mutex};

/// The texts of one kind's statements on one table.
pub(crate) trait KindSql: Any + Send + Sync {
    /// The texts, `{table}` filled in with `table` (already quoted).
    fn build(table: &str) -> Self
    where
        Self: Sized;
}

/// The texts each kind has built so far on one table (one per kind; a handful at most).
pub(crate) struct KindSqls {
    /// The quoted table name.
    table: Arc<str>,
    built: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for KindSqls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KindSqls")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl KindSqls {
    /// An empty set for the table `table` (quoted).
    pub(crate) fn new(table: &str) -> Arc<KindSqls> {
        Arc::new(KindSqls {
            table: table.into(),
            built: Mutex::new(Vec::new()),
        })
    }

    /// Kind `T`'s texts on this table, built on first use.
    pub(crate) fn get<T: KindSql>(&self) -> Arc<T> {
        let mut built = crate::sync::lock(&self.built);
        if let Some(b) = built.iter().find(|b| (***b).is::<T>()) {
            if let Ok(texts) = b.clone().downcast::<T>() {
                return texts;
            }
        }
        let texts = Arc::new(T::build(&self.table));
        built.push(texts.clone());
        texts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct A(String);
    impl KindSql for A {
        fn build(table: &str) -> Self {
            A(format!("SELECT 1 FROM {table}"))
        }
    }
    struct B(usize);
    impl KindSql for B {
        fn build(table: &str) -> Self {
            B(table.len())
        }
    }

    #[test]
    fn each_kind_builds_its_texts_once_per_table() {
        let sqls = KindSqls::new("\"t\"");
        let a = sqls.get::<A>();
        assert_eq!(a.0, "SELECT 1 FROM \"t\"");
        assert_eq!(sqls.get::<B>().0, 3);
        assert!(Arc::ptr_eq(&a, &sqls.get::<A>()));
        assert_eq!(sqls.built.lock().unwrap().len(), 2);
    }
}
