//! Identifiers: sessions, runs and step names, parsed and displayed in one place.
//!
//! Ids are immutable and cloned often (events, tool contexts, store keys), so they share their
//! text (`Arc<str>`): a clone is a reference count, not an allocation.

use std::fmt;
use std::sync::Arc;

use crate::error::{ErrorCode, RunFailure};

/// Equality and hashing of an id that shares its text: two clones of one id are equal without
/// reading the text. (`Arc`'s own `==` skips the read only for sized values, not for `str`; ids
/// are compared on every store write and map lookup, and most compare a clone with itself.)
macro_rules! shared_text_identity {
    ($id:ty) => {
        impl PartialEq for $id {
            fn eq(&self, other: &Self) -> bool {
                Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
            }
        }

        impl Eq for $id {}

        impl std::hash::Hash for $id {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                self.0.hash(state);
            }
        }
    };
}

/// A session (conversation) id: 1 to 128 characters of `A-Za-z0-9_-`.
///
/// The restriction keeps ids safe in URLs, file names and log lines.
#[derive(Clone, Debug, PartialOrd, Ord)]
pub struct SessionId(Arc<str>);

shared_text_identity!(SessionId);

impl SessionId {
    /// Validates and wraps a session id.
    pub fn new(id: impl AsRef<str>) -> Result<SessionId, RunFailure> {
        // Borrowed: the shared text is the one allocation, whatever the caller passes.
        let id = id.as_ref();
        let valid_chars = id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if id.is_empty() || id.len() > 128 || !valid_chars {
            return Err(RunFailure::new(
                ErrorCode::SessionIdInvalid,
                format!("invalid session id {id:?}: use 1 to 128 characters of A-Z, a-z, 0-9, `_` and `-`"),
            ));
        }
        Ok(SessionId(id.into()))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The separator between an owner's scope and the id a client gave (a character client ids
    /// cannot contain, so the split is unambiguous).
    pub const SCOPE_SEPARATOR: char = '~';

    /// `id` within an owner's scope (`<scope>~<id>`): with per-user auth, every user's session
    /// ids live apart, so one user can neither see nor guess into another's sessions. `scope`
    /// is a digest of the owner, made of id characters.
    pub fn scoped(scope: &str, id: &SessionId) -> SessionId {
        SessionId(format!("{scope}{}{}", Self::SCOPE_SEPARATOR, id.0).into())
    }

    /// The session of a subagent's run for one tool call (`sub-<name>-<hash of run and call>`),
    /// in the same owner's scope: deterministic, so a replay of the call finds the run it
    /// started instead of starting a second one.
    pub fn child(&self, run: &RunId, call_id: &str, name: &str) -> SessionId {
        let hash = stable_hash(&[run.as_str(), call_id, name]);
        let short: String =
            name.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-').take(64).collect();
        let id = SessionId(format!("sub-{short}-{hash:016x}").into());
        match self.0.split_once(Self::SCOPE_SEPARATOR) {
            Some((scope, _)) => SessionId::scoped(scope, &id),
            None => id,
        }
    }

    /// The id as its client knows it: without the owner's scope.
    pub fn external(&self) -> &str {
        self.0.split_once(Self::SCOPE_SEPARATOR).map_or(&self.0, |(_, id)| id)
    }

    /// A session id read back from a store: a client id, or a scoped one.
    pub fn from_store(id: impl Into<String>) -> Result<SessionId, RunFailure> {
        let id = id.into();
        match id.split_once(Self::SCOPE_SEPARATOR) {
            Some((scope, rest))
                if !scope.is_empty()
                    && scope.len() <= 64
                    && scope.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
            {
                let inner = SessionId::new(rest)?;
                Ok(SessionId::scoped(scope, &inner))
            }
            _ => SessionId::new(id),
        }
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// A run id, `run_` followed by a unique suffix chosen by the runtime.
#[derive(Clone, Debug, PartialOrd, Ord)]
pub struct RunId(Arc<str>);

shared_text_identity!(RunId);

impl RunId {
    /// The prefix every run id starts with.
    pub const PREFIX: &'static str = "run_";

    /// Builds a run id from a unique suffix (the runtime uses a time-ordered UUID).
    pub fn from_suffix(suffix: &str) -> RunId {
        // Put together on the stack when it fits (a generated suffix always does): one
        // allocation, the shared string's, rather than a `String` first.
        let mut buffer = [0u8; 64];
        let prefix = Self::PREFIX.len();
        if let Some(id) = buffer.get_mut(..prefix + suffix.len()) {
            id[..prefix].copy_from_slice(Self::PREFIX.as_bytes());
            id[prefix..].copy_from_slice(suffix.as_bytes());
            if let Ok(id) = std::str::from_utf8(id) {
                return RunId(id.into());
            }
        }
        let mut id = String::with_capacity(prefix + suffix.len());
        id.push_str(Self::PREFIX);
        id.push_str(suffix);
        RunId(id.into())
    }

    /// The run id of a subagent's run for one tool call, derived like [`SessionId::child`].
    pub fn child_run(run: &RunId, call_id: &str, name: &str) -> RunId {
        let high = stable_hash(&[run.as_str(), call_id, name]);
        let low = stable_hash(&[name, call_id, run.as_str()]);
        RunId::from_suffix(&format!("sub{high:016x}{low:016x}"))
    }

    /// The prefix of delayed runs' ids (a delayed run, or a schedule's fire): stored before
    /// they start, they are the runs whose start the store checks against their timer.
    pub const DELAYED_PREFIX: &'static str = "run_at_";

    /// A delayed run's id, from a unique suffix.
    pub fn delayed(suffix: &str) -> RunId {
        RunId(format!("{}{suffix}", Self::DELAYED_PREFIX).into())
    }

    /// Whether this is a delayed run's id ([`RunId::delayed`]).
    pub fn is_delayed(&self) -> bool {
        self.0.starts_with(Self::DELAYED_PREFIX)
    }

    /// Parses a run id as printed by [`RunId`]'s `Display`.
    pub fn parse(id: &str) -> Option<RunId> {
        let suffix = id.strip_prefix(Self::PREFIX)?;
        let valid = !suffix.is_empty()
            && suffix.len() <= 64
            && suffix.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        valid.then(|| RunId(id.into()))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// The name of a step of a run, the key of its journal entry.
///
/// Displayed as `llm:turn:N`, `llm:compact:N`, `memory:NAME`, `tool:NAME:CALL_ID`, `approval:CALL_ID`
/// or `question:CALL_ID`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StepName {
    /// One model call; turns count from 0 within the run.
    ModelTurn(u32),
    /// One tool call.
    Tool {
        /// The tool's name.
        name: String,
        /// The call id.
        call_id: String,
    },
    /// A human's decision on a tool call that needs approval.
    Approval(String),
    /// A human's answer to an `ask_question` call.
    Question(String),
    /// A compaction of the conversation (a model call that writes the brief); counts from 0
    /// within the run.
    Compact(u32),
    /// A memory step (`memory:recall`, `memory:traverse`, `memory:episode`, `memory:extract`).
    Memory(String),
}

impl StepName {
    /// Parses the display form back (used when reading a journal).
    pub fn parse(text: &str) -> Option<StepName> {
        if let Some(turn) = text.strip_prefix("llm:turn:") {
            return turn.parse().ok().map(StepName::ModelTurn);
        }
        if let Some(n) = text.strip_prefix("llm:compact:") {
            return n.parse().ok().map(StepName::Compact);
        }
        if let Some(name) = text.strip_prefix("memory:") {
            return Some(StepName::Memory(name.to_owned()));
        }
        if let Some(call_id) = text.strip_prefix("approval:") {
            return Some(StepName::Approval(call_id.to_owned()));
        }
        if let Some(call_id) = text.strip_prefix("question:") {
            return Some(StepName::Question(call_id.to_owned()));
        }
        let rest = text.strip_prefix("tool:")?;
        // Tool names cannot contain `:` (see `tool::validate_tool_name`), call ids can.
        let (name, call_id) = rest.split_once(':')?;
        Some(StepName::Tool { name: name.to_owned(), call_id: call_id.to_owned() })
    }
}

impl StepName {
    /// `<run_id>:<step>`: the idempotency key tools get for this step. Built without the
    /// formatting machinery: it is made for every tool call.
    pub fn idempotency_key(&self, run: &RunId) -> String {
        match self {
            StepName::ModelTurn(_)
            | StepName::Compact(_)
            | StepName::Memory(_)
            | StepName::Approval(_)
            | StepName::Question(_) => {
                format!("{run}:{self}")
            }
            StepName::Tool { name, call_id } => {
                let mut key = String::with_capacity(run.0.len() + name.len() + call_id.len() + 7);
                for piece in [&*run.0, ":tool:", name, ":", call_id] {
                    key.push_str(piece);
                }
                key
            }
        }
    }
}

impl fmt::Display for StepName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepName::ModelTurn(turn) => write!(f, "llm:turn:{turn}"),
            StepName::Tool { name, call_id } => write!(f, "tool:{name}:{call_id}"),
            StepName::Approval(call_id) => write!(f, "approval:{call_id}"),
            StepName::Question(call_id) => write!(f, "question:{call_id}"),
            StepName::Compact(n) => write!(f, "llm:compact:{n}"),
            StepName::Memory(name) => write!(f, "memory:{name}"),
        }
    }
}

/// A 64-bit hash that is the same across builds and platforms (the std hashers are not): FNV-1a
/// over the parts, separated by NUL, then MurmurHash3's final mix so that inputs differing in
/// one character give values that look nothing alike.
pub fn stable_hash(parts: &[&str]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, part) in parts.iter().enumerate() {
        let separator: &[u8] = if i == 0 { &[] } else { &[0] };
        for &byte in separator.iter().chain(part.as_bytes()) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^= hash >> 33;
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_equal_by_their_text_whether_clones_or_not() {
        use std::hash::BuildHasher;
        let hasher = std::hash::RandomState::new();
        let session = SessionId::new("s1").unwrap();
        let same_text = SessionId::new(String::from("s1")).unwrap();
        assert_eq!(session, session.clone());
        assert_eq!(session, same_text);
        assert_ne!(session, SessionId::new("s2").unwrap());
        assert_eq!(hasher.hash_one(&session), hasher.hash_one(&same_text));
        let run = RunId::from_suffix("x");
        assert_eq!(run, run.clone());
        assert_eq!(run, RunId::from_suffix("x"));
        assert_ne!(run, RunId::from_suffix("y"));
        assert_eq!(hasher.hash_one(&run), hasher.hash_one(RunId::from_suffix("x")));
    }

    #[test]
    fn scoped_session_ids_keep_owners_apart_and_read_back() {
        let id = SessionId::new("x".repeat(128)).unwrap();
        let alice = SessionId::scoped("a1b2", &id);
        let bob = SessionId::scoped("c3d4", &id);
        assert_ne!(alice, bob);
        assert_eq!(alice.external(), id.as_str());
        assert_eq!(SessionId::from_store(alice.as_str()).unwrap(), alice);
        assert_eq!(SessionId::from_store("plain").unwrap().external(), "plain");
        // A client cannot name a scoped id itself, nor can a store smuggle a bad one in.
        assert!(SessionId::new(alice.as_str()).is_err());
        for bad in ["~x", "a b~x", "a~b~c", "a~", &format!("{}~x", "s".repeat(65))] {
            assert!(SessionId::from_store(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn session_ids_are_checked() {
        assert!(SessionId::new("abc_DEF-123").is_ok());
        assert!(SessionId::new("x".repeat(128)).is_ok());
        for bad in ["", "a b", "a/b", "é", &"x".repeat(129)] {
            let err = SessionId::new(bad).unwrap_err();
            assert_eq!(err.code, ErrorCode::SessionIdInvalid, "{bad:?}");
        }
    }

    #[test]
    fn step_names_round_trip() {
        for step in [
            StepName::ModelTurn(0),
            StepName::ModelTurn(41),
            StepName::Tool { name: "day_name".into(), call_id: "call:1".into() },
            StepName::Approval("call_0_1".into()),
            StepName::Question("toolu:9".into()),
        ] {
            assert_eq!(StepName::parse(&step.to_string()), Some(step.clone()));
            let run = RunId::from_suffix("r");
            assert_eq!(step.idempotency_key(&run), format!("{run}:{step}"));
        }
        assert_eq!(StepName::parse("llm:turn:x"), None);
        assert_eq!(StepName::parse("other"), None);
    }

    #[test]
    fn run_ids_parse() {
        let id = RunId::from_suffix("0190abc");
        assert_eq!(id.as_str(), "run_0190abc");
        assert_eq!(RunId::parse("run_0190abc"), Some(id));
        assert_eq!(RunId::parse("run_"), None);
        assert_eq!(RunId::parse("job_1"), None);
        assert_eq!(RunId::parse("run_a/b"), None);
    }
}
