//! The statements this build can send: each backend's trait for sending a statement value (see
//! `backend_trait!` in `dialect.rs`), with a stand-in for every backend the build leaves out,
//! gathered as [`Runs`]. The one file, with the `Backend` enum, that names every backend.

#[cfg(feature = "mysql")]
use super::mysql;
#[cfg(feature = "postgres")]
use super::postgres;
#[cfg(feature = "sqlite")]
use super::sqlite;
use super::Statement;

#[cfg(feature = "mysql")]
pub(crate) use mysql::OnMySql;
#[cfg(feature = "postgres")]
pub(crate) use postgres::OnPostgres;
#[cfg(feature = "sqlite")]
pub(crate) use sqlite::OnSqlite;

/// Stand-ins for the traits of the backends a build leaves out: every statement "runs" there.
#[cfg(not(feature = "postgres"))]
pub(crate) trait OnPostgres {}
#[cfg(not(feature = "postgres"))]
impl<T: ?Sized> OnPostgres for T {}
#[cfg(not(feature = "mysql"))]
pub(crate) trait OnMySql {}
#[cfg(not(feature = "mysql"))]
impl<T: ?Sized> OnMySql for T {}
#[cfg(not(feature = "sqlite"))]
pub(crate) trait OnSqlite {}
#[cfg(not(feature = "sqlite"))]
impl<T: ?Sized> OnSqlite for T {}

/// A statement every backend of this build can send: what [`Backend::run`](super::Backend::run)
/// runs (each backend declares its trait with `backend_trait!`).
pub(crate) trait Runs: Statement + OnPostgres + OnMySql + OnSqlite {}
impl<T: Statement + OnPostgres + OnMySql + OnSqlite> Runs for T {}
