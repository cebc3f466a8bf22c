//! The handshake's messages: the parent's challenge, the worker's hello, the parent's
//! answer; each side's proof is the core's [`mac`] of the other's fresh nonce under the
//! ticket's token, in a domain of its own.

use serde_json::{json, Value};

use shmq_core::auth::{
    mac, mac_eq, new_secret, secret_from_text, secret_to_text, to_hex, SECRET_BYTES,
};

use super::{Kind, LinkError, PROTOCOL_VERSION};

const HELLO_TAG: &[u8] = b"shmq worker hello";
const WELCOME_TAG: &[u8] = b"shmq worker welcome";

/// A fresh nonce for the handshake: 32 random bytes from the kernel, in a secret's text
/// form (64 hexadecimal digits).
///
/// # Errors
///
/// [`crate::Error::Core`] with `Os` when the kernel gives no random bytes (`getrandom`
/// refused).
pub fn new_nonce() -> crate::Result<String> {
    Ok(secret_to_text(&new_secret("a worker handshake's nonce")?))
}

/// The worker's proof that it knows `token`: the MAC of the parent's nonce, the rank, the
/// pid, the host it names and its own nonce (each as the text it is sent as).
pub fn hello_mac(
    token: &[u8; SECRET_BYTES],
    parent_nonce: &str,
    rank: u64,
    pid: u64,
    host: &str,
    worker_nonce: &str,
) -> [u8; 32] {
    let (rank, pid) = (rank.to_string(), pid.to_string());
    let parts: [&[u8]; 5] = [
        parent_nonce.as_bytes(),
        rank.as_bytes(),
        pid.as_bytes(),
        host.as_bytes(),
        worker_nonce.as_bytes(),
    ];
    mac(token, HELLO_TAG, &parts)
}

/// The parent's proof that it knows `token`, over the worker's nonce: what the worker
/// checks before it takes the parent's word for anything.
pub fn welcome_mac(
    token: &[u8; SECRET_BYTES],
    worker_nonce: &str,
    parent_nonce: &str,
    rank: u64,
) -> [u8; 32] {
    let rank = rank.to_string();
    let parts: [&[u8]; 3] = [
        worker_nonce.as_bytes(),
        parent_nonce.as_bytes(),
        rank.as_bytes(),
    ];
    mac(token, WELCOME_TAG, &parts)
}

/// Whether `claimed` (text) is `want` as hexadecimal digits (compared in constant time).
fn is_proof(want: &[u8; 32], claimed: &str) -> bool {
    match secret_from_text(claimed) {
        Some(bytes) => mac_eq(want, &bytes),
        None => false,
    }
}

/// The parent's challenge's payload.
pub fn challenge_payload(nonce: &str) -> Vec<u8> {
    json!({"nonce": nonce, "version": PROTOCOL_VERSION})
        .to_string()
        .into_bytes()
}

/// The parent's nonce from its challenge (a frame of `kind` with `payload`); `peer` names
/// the parent in errors: [`LinkError::Malformed`] for what is no shmq parent's challenge,
/// [`LinkError::Refused`] for a parent of another protocol version.
///
/// # Errors
///
/// [`LinkError::Malformed`] for a frame that is not a challenge or holds no nonce;
/// [`LinkError::Refused`] for a parent that speaks another version of the protocol.
pub fn read_challenge(kind: u8, payload: &[u8], peer: &str) -> Result<String, LinkError> {
    if kind != Kind::Challenge.byte() {
        return Err(LinkError::Malformed(format!(
            "{peer} is not a shmq worker parent"
        )));
    }
    let malformed = || LinkError::Malformed(format!("{peer} sent a malformed challenge"));
    let challenge: Value = serde_json::from_slice(payload).map_err(|_| malformed())?;
    let nonce = challenge
        .get("nonce")
        .and_then(Value::as_str)
        .filter(|n| secret_from_text(n).is_some())
        .ok_or_else(malformed)?;
    let version = challenge.get("version");
    if version.and_then(Value::as_u64) != Some(PROTOCOL_VERSION) {
        let theirs = version.map_or("1".to_owned(), Value::to_string);
        return Err(LinkError::Refused(format!(
            "the parent at {peer} speaks worker protocol {theirs}, this worker \
             {PROTOCOL_VERSION}: run the same shmq version on both machines"
        )));
    }
    Ok(nonce.to_owned())
}

/// A worker's hello: who it says it is, its nonce, and its proof ([`hello_mac`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The rank it joins as.
    pub rank: u32,
    /// Its process id (on its machine).
    pub pid: u32,
    /// The host it names.
    pub host: String,
    /// Its fresh nonce (64 hexadecimal digits).
    pub nonce: String,
    /// Its proof, as hexadecimal digits.
    pub mac: String,
}

impl Hello {
    /// The hello of worker `rank` (process `pid` on `host`) to the parent whose challenge
    /// carried `parent_nonce`, with a fresh nonce of its own.
    ///
    /// # Errors
    ///
    /// As [`new_nonce`]: the kernel gives no random bytes.
    pub fn new(
        token: &[u8; SECRET_BYTES],
        parent_nonce: &str,
        rank: u32,
        pid: u32,
        host: &str,
    ) -> crate::Result<Hello> {
        let nonce = new_nonce()?;
        let proof = hello_mac(token, parent_nonce, rank.into(), pid.into(), host, &nonce);
        Ok(Hello {
            rank,
            pid,
            host: host.to_owned(),
            nonce,
            mac: to_hex(&proof),
        })
    }

    /// Its payload (JSON).
    pub fn encode(&self) -> Vec<u8> {
        json!({
            "rank": self.rank,
            "pid": self.pid,
            "host": self.host,
            "nonce": self.nonce,
            "mac": self.mac,
        })
        .to_string()
        .into_bytes()
    }

    /// The hello in a frame of `kind` with `payload`, not yet checked; `Err` says why it
    /// is refused (what the parent answers).
    ///
    /// # Errors
    ///
    /// The refusal's text for a frame that is not a hello, malformed JSON (or nested too
    /// deep), or a field missing or of the wrong type.
    pub fn decode(kind: u8, payload: &[u8]) -> Result<Hello, String> {
        const MALFORMED: &str = "malformed hello";
        if kind != Kind::Hello.byte() {
            return Err(MALFORMED.to_owned());
        }
        let hello: Value = serde_json::from_slice(payload).map_err(|e| {
            if e.to_string().starts_with("recursion limit exceeded") {
                format!("{MALFORMED}: a hello nested too deep")
            } else {
                MALFORMED.to_owned()
            }
        })?;
        let field = |name: &str| hello.get(name);
        let number = |name: &str| {
            field(name)
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
        };
        let (Some(rank), Some(pid), Some(Value::String(mac))) =
            (number("rank"), number("pid"), field("mac"))
        else {
            return Err(MALFORMED.to_owned());
        };
        let Some(nonce) = field("nonce")
            .and_then(Value::as_str)
            .filter(|n| secret_from_text(n).is_some())
        else {
            return Err(format!(
                "{MALFORMED} (no nonce: a worker of an older shmq?)"
            ));
        };
        let Some(Value::String(host)) = field("host") else {
            return Err(MALFORMED.to_owned());
        };
        Ok(Hello {
            rank,
            pid,
            host: host.clone(),
            nonce: nonce.to_owned(),
            mac: mac.clone(),
        })
    }

    /// Whether its proof is [`hello_mac`] under `token` over `parent_nonce`.
    pub fn is_genuine(&self, token: &[u8; SECRET_BYTES], parent_nonce: &str) -> bool {
        let want = hello_mac(
            token,
            parent_nonce,
            self.rank.into(),
            self.pid.into(),
            &self.host,
            &self.nonce,
        );
        is_proof(&want, &self.mac)
    }

    /// The hello in a frame of `kind` with `payload`, if it is well formed and proves
    /// `token` over `parent_nonce`; `Err` says why not ("wrong token", "malformed
    /// hello...").
    ///
    /// # Errors
    ///
    /// As [`decode`](Self::decode), or "wrong token" when its proof is not the MAC of
    /// `token` over `parent_nonce`.
    pub fn check(
        kind: u8,
        payload: &[u8],
        token: &[u8; SECRET_BYTES],
        parent_nonce: &str,
    ) -> Result<Hello, String> {
        let hello = Hello::decode(kind, payload)?;
        if !hello.is_genuine(token, parent_nonce) {
            return Err("wrong token".to_owned());
        }
        Ok(hello)
    }
}

/// The parent's answer that admits worker `rank`: its proof over the worker's nonce.
pub fn welcome_payload(
    token: &[u8; SECRET_BYTES],
    worker_nonce: &str,
    parent_nonce: &str,
    rank: u32,
) -> Vec<u8> {
    let proof = welcome_mac(token, worker_nonce, parent_nonce, rank.into());
    json!({"ok": true, "mac": to_hex(&proof)})
        .to_string()
        .into_bytes()
}

/// The most characters of a refusal's reason the answer carries: even escaped (six bytes
/// a character at most in JSON), the answer stays within [`MAX_HELLO_FRAME`](super::MAX_HELLO_FRAME).
const MAX_REASON_CHARS: usize = 512;

/// The parent's answer that refuses a worker, saying why (the reason's first
/// 512 characters, so the answer fits in [`MAX_HELLO_FRAME`](super::MAX_HELLO_FRAME)).
pub fn refusal_payload(error: &str) -> Vec<u8> {
    let error: String = match error.char_indices().nth(MAX_REASON_CHARS) {
        Some((cut, _)) => format!("{}...", &error[..cut]),
        None => error.to_owned(),
    };
    json!({"ok": false, "error": error})
        .to_string()
        .into_bytes()
}

/// Check the parent's answer (a frame of `kind` with `payload`) to the hello of worker
/// `rank`: `Ok` if it admits the worker and proves `token` over `worker_nonce`;
/// [`LinkError::Refused`] if it refused the worker or cannot prove the token (it is not
/// the parent that issued the ticket). `peer` names the parent in errors.
///
/// # Errors
///
/// [`LinkError::Refused`] when the parent refused the worker (its reason) or its proof of
/// `token` is wrong; [`LinkError::Malformed`] for a frame that is not an answer, or a
/// malformed one.
pub fn read_answer(
    kind: u8,
    payload: &[u8],
    token: &[u8; SECRET_BYTES],
    worker_nonce: &str,
    parent_nonce: &str,
    rank: u32,
    peer: &str,
) -> Result<(), LinkError> {
    let answer: Value = if kind == Kind::Answer.byte() {
        serde_json::from_slice(payload).unwrap_or(Value::Null)
    } else {
        json!({"ok": false, "error": "no answer"})
    };
    if answer.get("ok") != Some(&Value::Bool(true)) {
        let error = match answer.get("error") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None if answer.is_object() => "no reason given".to_owned(),
            None => "a malformed answer".to_owned(),
        };
        return Err(LinkError::Refused(format!(
            "the parent at {peer} refused worker rank {rank}: {error}"
        )));
    }
    let want = welcome_mac(token, worker_nonce, parent_nonce, rank.into());
    if !answer
        .get("mac")
        .and_then(Value::as_str)
        .is_some_and(|claimed| is_proof(&want, claimed))
    {
        return Err(LinkError::Refused(format!(
            "{peer} admitted worker rank {rank} without proving it knows the ticket's token: \
             not the parent that issued this ticket"
        )));
    }
    Ok(())
}
