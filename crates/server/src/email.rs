//! The email channel's gate (DESIGN.md §8): a message is accepted only when its receiving
//! server vouches for its `From:` domain.
//!
//! The message is raw RFC 5322, parsed with `mail-parser` (0.11: 1.0 needs a newer Rust). Its receiving server recorded what
//! it checked in `Authentication-Results` (RFC 8601), which this module reads (no crate parses
//! that header): some DMARC, SPF or DKIM result must be `pass` for a domain exactly equal to the
//! `From:` domain (strict alignment: `mail.example.com` does not vouch for `example.com`, and a
//! pass that names no domain vouches for nothing). Only the receiving server's own header is
//! believed: the one whose authserv-id the channel names (`authserv_id`), else the topmost one,
//! which the last server prepended; a sender can write any header below it. A message with no
//! single `From:` address is refused.

use mail_parser::MessageParser;

/// What the gate needs of a message, and what a run is told.
#[derive(Debug)]
pub(crate) struct Mail {
    /// The one `From:` address, lowercased.
    pub(crate) from: String,
    /// Its domain.
    pub(crate) from_domain: String,
    /// The `To:` and `Cc:` addresses, lowercased.
    pub(crate) recipients: Vec<String>,
    pub(crate) subject: String,
    pub(crate) text: String,
    pub(crate) message_id: Option<String>,
    /// The `Authentication-Results` values, top first, unfolded.
    pub(crate) auth_results: Vec<String>,
}

/// Reads a raw message. Fails (for the bounce, which says nothing more) when it has no single
/// `From:` address.
pub(crate) fn read(raw: &[u8]) -> Result<Mail, &'static str> {
    let message = MessageParser::default().parse(raw).ok_or("not a message")?;
    // One `From:` header with one address: anything else is ambiguous about who sent it.
    let from_headers = message.headers_raw().filter(|(name, _)| name.eq_ignore_ascii_case("from")).count();
    if from_headers != 1 {
        return Err("no single From header");
    }
    let from: Vec<String> = message
        .from()
        .map(|list| list.iter().filter_map(|a| a.address().map(str::to_ascii_lowercase)).collect())
        .unwrap_or_default();
    let [from] = from.as_slice() else { return Err("no single From address") };
    let from_domain = domain_of(from).ok_or("no From domain")?;
    let recipients = [message.to(), message.cc()]
        .into_iter()
        .flatten()
        .flat_map(|list| list.iter().filter_map(|a| a.address().map(str::to_ascii_lowercase)))
        .collect();
    let auth_results = message
        .headers_raw()
        .filter(|(name, _)| name.eq_ignore_ascii_case("authentication-results"))
        .map(|(_, value)| unfold(value))
        .collect();
    Ok(Mail {
        from: from.clone(),
        from_domain,
        recipients,
        subject: message.subject().unwrap_or_default().to_owned(),
        text: message.body_text(0).map(|text| text.into_owned()).unwrap_or_default(),
        message_id: message.message_id().map(str::to_owned),
        auth_results,
    })
}

fn domain_of(address: &str) -> Option<String> {
    let domain = address.rsplit_once('@')?.1.trim().trim_end_matches('.').to_ascii_lowercase();
    (!domain.is_empty()).then_some(domain)
}

fn unfold(value: &str) -> String {
    value.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether the receiving server vouches for `mail`'s `From:` domain (see the module docs).
pub(crate) fn vouched(mail: &Mail, trusted_authserv_id: Option<&str>) -> bool {
    let believed: Vec<AuthResults> = match trusted_authserv_id {
        Some(trusted) => mail
            .auth_results
            .iter()
            .filter_map(|value| parse_auth_results(value))
            .filter(|results| results.authserv_id.eq_ignore_ascii_case(trusted))
            .collect(),
        None => mail.auth_results.first().and_then(|value| parse_auth_results(value)).into_iter().collect(),
    };
    believed.iter().flat_map(|results| &results.results).any(|result| {
        result.result == "pass" && result.domain().is_some_and(|domain| domain == mail.from_domain)
    })
}

/// One `Authentication-Results` header.
#[derive(Debug, PartialEq)]
struct AuthResults {
    authserv_id: String,
    results: Vec<MethodResult>,
}

/// One `method=result` with its properties (`header.from=...`, `smtp.mailfrom=...`).
#[derive(Debug, PartialEq)]
struct MethodResult {
    method: String,
    result: String,
    properties: Vec<(String, String)>,
}

impl MethodResult {
    fn property(&self, name: &str) -> Option<&str> {
        self.properties.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str())
    }

    /// The domain a passing result vouches for: DMARC `header.from`, SPF `smtp.mailfrom` (its
    /// domain), DKIM `header.d` (or the domain of `header.i`).
    fn domain(&self) -> Option<String> {
        let value = match self.method.as_str() {
            "dmarc" => self.property("header.from")?,
            "spf" => self.property("smtp.mailfrom")?,
            "dkim" => self.property("header.d").or_else(|| self.property("header.i"))?,
            _ => return None,
        };
        let domain = match value.rsplit_once('@') {
            Some((_, domain)) => domain,
            None => value,
        };
        let domain = domain.trim().trim_end_matches('.').to_ascii_lowercase();
        (!domain.is_empty()).then_some(domain)
    }
}

/// Removes RFC 5322 comments (nested parentheses, outside quoted strings).
fn strip_comments(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let (mut depth, mut quoted, mut escaped) = (0u32, false, false);
    for c in value.chars() {
        if escaped {
            escaped = false;
            if depth == 0 {
                out.push(c);
            }
            continue;
        }
        match c {
            '\\' => {
                escaped = true;
                if depth == 0 {
                    out.push(c);
                }
            }
            '"' if depth == 0 => {
                quoted = !quoted;
                out.push(c);
            }
            '(' if !quoted => depth += 1,
            ')' if !quoted && depth > 0 => {
                depth -= 1;
                out.push(' ');
            }
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// Splits on `separator` outside quoted strings.
fn split_unquoted(value: &str, separator: char) -> Vec<String> {
    let mut parts = vec![String::new()];
    let (mut quoted, mut escaped) = (false, false);
    for c in value.chars() {
        let part = parts.last_mut().expect("never empty");
        match c {
            _ if escaped => {
                escaped = false;
                part.push(c);
            }
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            c if c == separator && !quoted => parts.push(String::new()),
            c => part.push(c),
        }
    }
    parts
}

/// Parses an `Authentication-Results` value: `authserv-id [version]; method=result
/// ptype.property=value ...; ...`. `None` when it has no authserv-id.
fn parse_auth_results(value: &str) -> Option<AuthResults> {
    let cleaned = strip_comments(value);
    let mut parts = split_unquoted(&cleaned, ';').into_iter();
    let authserv_id = parts.next()?.split_whitespace().next()?.to_owned();
    let mut results = Vec::new();
    for part in parts {
        let mut tokens = split_unquoted(part.trim(), ' ').into_iter().filter(|t| !t.is_empty());
        let Some(first) = tokens.next() else { continue };
        let Some((method, result)) = first.split_once('=') else { continue };
        // `dkim/1=pass`: a method version.
        let method = method.split('/').next().unwrap_or(method).trim().to_ascii_lowercase();
        let properties = tokens
            .filter_map(|token| {
                let (key, value) = token.split_once('=')?;
                Some((key.trim().to_ascii_lowercase(), value.trim().to_owned()))
            })
            .collect();
        results.push(MethodResult { method, result: result.trim().to_ascii_lowercase(), properties });
    }
    Some(AuthResults { authserv_id, results })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(from: &str, auth_results: &[&str]) -> Vec<u8> {
        let mut raw = String::new();
        for header in auth_results {
            raw.push_str(&format!("Authentication-Results: {header}\r\n"));
        }
        raw.push_str(&format!(
            "From: {from}\r\nTo: Support <support@keel.example>\r\nSubject: Help\r\nMessage-ID: <m1@example.com>\r\n\r\nMy order is late.\r\n"
        ));
        raw.into_bytes()
    }

    fn verdict(from: &str, auth_results: &[&str], trusted: Option<&str>) -> bool {
        read(&message(from, auth_results)).is_ok_and(|mail| vouched(&mail, trusted))
    }

    #[test]
    fn the_gate_takes_only_a_pass_for_exactly_the_from_domain() {
        let ann = "Ann <ann@example.com>";
        let table: &[(&str, &[&str], Option<&str>, bool)] = &[
            (
                "aligned DMARC",
                &["mx.keel.example; dmarc=pass (p=reject) header.from=example.com"],
                None,
                true,
            ),
            ("aligned SPF", &["mx.keel.example; spf=pass smtp.mailfrom=ann@example.com"], None, true),
            ("aligned DKIM", &["mx.keel.example; dkim=pass header.d=example.com header.s=sel"], None, true),
            ("DKIM by header.i", &["mx.keel.example; dkim=pass header.i=@example.com"], None, true),
            ("a domain's case", &["mx.keel.example; dmarc=pass header.from=EXAMPLE.com."], None, true),
            ("a subdomain", &["mx.keel.example; dkim=pass header.d=mail.example.com"], None, false),
            (
                "a parent domain",
                &["mx.keel.example; spf=pass smtp.mailfrom=example.com.evil.test"],
                None,
                false,
            ),
            ("no domain", &["mx.keel.example; dmarc=pass"], None, false),
            ("a fail", &["mx.keel.example; dmarc=fail header.from=example.com"], None, false),
            (
                "softfail and none",
                &["mx.keel.example; spf=softfail smtp.mailfrom=example.com; dkim=none"],
                None,
                false,
            ),
            ("another domain passes", &["mx.keel.example; dkim=pass header.d=other.test"], None, false),
            ("no results", &["mx.keel.example; none"], None, false),
            ("no header", &[], None, false),
            (
                "multiple results, one aligned",
                &["mx.keel.example; spf=fail smtp.mailfrom=example.com; dkim=pass header.d=example.com"],
                None,
                true,
            ),
            (
                "a comment is not a result",
                &["mx.keel.example; dkim=fail (dkim=pass header.d=example.com) header.d=example.com"],
                None,
                false,
            ),
            ("a quoted value", &["mx.keel.example; dmarc=pass header.from=\"example.com\""], None, true),
            (
                "a forged header below the server's",
                &[
                    "mx.keel.example; dmarc=fail header.from=example.com",
                    "mx.keel.example; dmarc=pass header.from=example.com",
                ],
                None,
                false,
            ),
            (
                "a forged header naming the trusted server, below it",
                &[
                    "mx.keel.example; dmarc=fail header.from=example.com",
                    "evil.test; dmarc=pass header.from=example.com",
                ],
                Some("mx.keel.example"),
                false,
            ),
            (
                "the trusted server's header under another server's",
                &[
                    "relay.test; dmarc=fail header.from=example.com",
                    "mx.keel.example; dmarc=pass header.from=example.com",
                ],
                Some("mx.keel.example"),
                true,
            ),
            (
                "another server's pass when one is trusted",
                &["evil.test; dmarc=pass header.from=example.com"],
                Some("mx.keel.example"),
                false,
            ),
        ];
        for (what, headers, trusted, expected) in table {
            assert_eq!(verdict(ann, headers, *trusted), *expected, "{what}");
        }
        let pass = &["mx.keel.example; dmarc=pass header.from=example.com"][..];
        assert!(!verdict("ann@example.com, bob@example.com", pass, None), "two From addresses");
        assert!(!verdict("undisclosed-recipients:;", pass, None), "no From address");
    }

    #[test]
    fn a_message_is_read_with_its_recipients_and_text() {
        let mail =
            read(&message("Ann <Ann@Example.com>", &["mx; dmarc=pass header.from=example.com"])).unwrap();
        assert_eq!((mail.from.as_str(), mail.from_domain.as_str()), ("ann@example.com", "example.com"));
        assert_eq!(mail.recipients, ["support@keel.example"]);
        assert_eq!((mail.subject.as_str(), mail.text.trim()), ("Help", "My order is late."));
        assert_eq!(mail.message_id.as_deref(), Some("m1@example.com"));
    }
}
