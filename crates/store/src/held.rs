//! A connection that keeps its statements: each SQL text the store writes in its code is
//! prepared at its first use and held, ready, for the connection's life.
//!
//! rusqlite's statement cache (`prepare_cached`) spares the parse, but not its own bookkeeping:
//! every use hashes the SQL text to find the statement, takes it out of an LRU list, and on the
//! way back clears its bindings, hashes the text again and puts it back, allocating the list's
//! node anew. A durable tool-loop run makes 34 statements, and that bookkeeping was a tenth of
//! its instructions (callgrind on the store bench: 393,000 a run through the cache, 356,000
//! with the statements held). Here a statement is found by where its text lives, `&'static str`
//! as the store's SQL is: a comparison of two words per statement held, and nothing allocated.
//! What was bound to it is cleared after each use, as the cache does (a statement held with a
//! tool's output bound would keep a copy of it until its next use).
//!
//! rusqlite ties a statement to the connection by a borrow (`Statement<'conn>`), so a struct
//! that holds both needs one `unsafe` step: the statements are stored as borrowing the
//! connection for `'static`. It is sound because the connection is boxed (its address never
//! changes while the struct lives), dropped after the statements (field order), and never
//! handed out by value; a statement is lent only for the span of a closure that cannot keep it
//! ([`HeldConnection::with_statement`]). The struct is `Send` for the same reason a `Connection`
//! is: what moves to another thread is the connection together with everything that refers to
//! it, and `&self` gives no way to reach it from two threads at once (it is not `Sync`).
//!
//! SQL built at run time (`format!`) goes through rusqlite's cache as before, and so does a
//! statement asked for again while its held one is in use (a query inside another's rows).

#![allow(
    unsafe_code,
    reason = "a struct holding rusqlite statements together with the connection they borrow"
)]

use std::cell::RefCell;
use std::ops::Deref;

use rusqlite::{Connection, PrepFlags, Statement};

/// A connection and the statements prepared on it (see the module docs).
pub(crate) struct HeldConnection {
    /// Declared before `connection`, so finalized before it closes: SQLite does not close a
    /// connection whose statements are still alive.
    held: RefCell<Vec<Held>>,
    connection: Box<Connection>,
}

/// One statement held, found by the address and length of its SQL text.
struct Held {
    sql: (usize, usize),
    statement: RefCell<Statement<'static>>,
}

// SAFETY: see the module docs. Every `Statement<'static>` in `held` borrows `*connection` alone,
// which moves with it; `RefCell` (not `Sync`) keeps two threads from using them at once.
unsafe impl Send for HeldConnection {}

impl HeldConnection {
    pub(crate) fn new(connection: Connection) -> HeldConnection {
        HeldConnection { held: RefCell::new(Vec::new()), connection: Box::new(connection) }
    }

    /// Runs `use_it` with the statement of `sql`, prepared at its first use and held after it,
    /// and then clears what it bound: a held statement would otherwise keep a copy of the last
    /// values bound to it (a message, a tool's output) until its next use.
    pub(crate) fn with_statement<R>(
        &self,
        sql: &'static str,
        use_it: impl FnOnce(&mut Statement<'_>) -> rusqlite::Result<R>,
    ) -> rusqlite::Result<R> {
        let key = (sql.as_ptr() as usize, sql.len());
        let Ok(held) = self.held.try_borrow() else {
            // Only while a statement is being added, which runs no other.
            return self.connection.prepare_cached(sql).and_then(|mut statement| use_it(&mut statement));
        };
        if let Some(found) = held.iter().find(|held| held.sql == key) {
            return match found.statement.try_borrow_mut() {
                Ok(mut statement) => {
                    let result = use_it(&mut statement);
                    statement.clear_bindings();
                    result
                }
                // In use further up the stack (its rows being read): another one for this use.
                Err(_) => {
                    self.connection.prepare_cached(sql).and_then(|mut statement| use_it(&mut statement))
                }
            };
        }
        drop(held);
        let statement = self.connection.prepare_with_flags(sql, PrepFlags::SQLITE_PREPARE_PERSISTENT)?;
        // SAFETY: the statement borrows `*self.connection`, boxed and dropped after `held` (see
        // the module docs); it is lent out only for closures that cannot keep it.
        let statement = unsafe { std::mem::transmute::<Statement<'_>, Statement<'static>>(statement) };
        match self.held.try_borrow_mut() {
            Ok(mut held) => held.push(Held { sql: key, statement: RefCell::new(statement) }),
            // A statement of the rows being read further up asked for it: used once, not held.
            Err(_) => {
                let mut statement = statement;
                return use_it(&mut statement);
            }
        }
        self.with_statement(sql, use_it)
    }

    /// How many statements are held (for the tests).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.borrow().len()
    }
}

impl Deref for HeldConnection {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        &self.connection
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connection() -> HeldConnection {
        let connection = Connection::open_in_memory().expect("an in-memory database");
        connection.execute_batch("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT NOT NULL)").expect("a table");
        HeldConnection::new(connection)
    }

    const INSERT: &str = "INSERT INTO t (k, v) VALUES (?1, ?2)";
    const SELECT: &str = "SELECT v FROM t WHERE k = ?1";
    const ALL: &str = "SELECT k FROM t ORDER BY k";

    #[test]
    fn a_statement_is_prepared_once_and_used_again() {
        let c = connection();
        for k in 0..100 {
            c.with_statement(INSERT, |s| s.execute(rusqlite::params![k, format!("v{k}")]))
                .expect("an insert");
        }
        let v: String = c.with_statement(SELECT, |s| s.query_row([42], |row| row.get(0))).expect("a row");
        assert_eq!(v, "v42");
        assert_eq!(c.held(), 2, "one statement per SQL text, however often used");
        // What was bound last time is replaced, not added to.
        let v: String = c.with_statement(SELECT, |s| s.query_row([7], |row| row.get(0))).expect("a row");
        assert_eq!(v, "v7");
    }

    #[test]
    fn a_held_statement_keeps_no_copy_of_what_was_bound_to_it() {
        let c = connection();
        let large = "x".repeat(4 << 20);
        let length: i64 = c
            .with_statement("SELECT length(?1)", |s| s.query_row([&large], |row| row.get(0)))
            .expect("a row");
        assert_eq!(length, 4 << 20);
        let held = c.held.borrow();
        let statement = held[0].statement.borrow();
        let used = statement.get_status(rusqlite::StatementStatus::MemUsed);
        assert!(used < 64 << 10, "the statement still holds {used} bytes after its use");
    }

    #[test]
    fn a_statement_asked_for_while_its_rows_are_read_gets_another() {
        let c = connection();
        for k in 0..5 {
            c.with_statement(INSERT, |s| s.execute(rusqlite::params![k, "x"])).expect("an insert");
        }
        // Each row of `ALL` reads `ALL` again (held one busy: rusqlite's cache) and `SELECT`
        // (held while `ALL`'s rows are read: used once).
        let pairs = c
            .with_statement(ALL, |s| {
                let keys = s.query_map([], |row| row.get::<_, i64>(0))?;
                keys.map(|k| {
                    let k = k?;
                    let count =
                        c.with_statement(ALL, |again| Ok(again.query_map([], |_| Ok(()))?.count()))?;
                    let v: String = c.with_statement(SELECT, |s| s.query_row([k], |row| row.get(0)))?;
                    Ok((k, count, v))
                })
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .expect("nested reads");
        assert_eq!(pairs.len(), 5);
        assert!(pairs.iter().all(|(_, count, v)| *count == 5 && v == "x"), "{pairs:?}");
        // `SELECT` was first asked for under `ALL`'s borrow: used, not held, and held at its
        // next use outside.
        let before = c.held();
        let _: String = c.with_statement(SELECT, |s| s.query_row([1], |row| row.get(0))).expect("a row");
        assert_eq!(c.held(), before + 1);
    }

    #[test]
    fn the_connection_moves_to_another_thread_with_its_statements() {
        let c = connection();
        c.with_statement(INSERT, |s| s.execute(rusqlite::params![1, "here"])).expect("an insert");
        let moved = std::thread::spawn(move || {
            c.with_statement(INSERT, |s| s.execute(rusqlite::params![2, "there"])).expect("an insert");
            let v: String = c.with_statement(SELECT, |s| s.query_row([1], |row| row.get(0))).expect("a row");
            (c, v)
        });
        let (c, v) = moved.join().expect("the thread");
        assert_eq!(v, "here");
        let n: i64 = c.query_row("SELECT count(*) FROM t", [], |row| row.get(0)).expect("a count");
        assert_eq!(n, 2);
    }
}
