//! A reader's get and touch of a signed handle (vLLM 0.33's `SingleWriterShmObjectStorage`
//! `get` and `touch` on a reader): the key and signature a request brings back with
//! `(address, id)` are checked here, before anything at the address is read, so that a
//! Rust reader gets the same refusals as a Python one. Which roles check is
//! [`StoreRole::checks_signatures`]; the writer made its handles itself and reads them
//! unchecked (its `touch` and `verify_signature` go through its index: see
//! [`ObjectStore::touch`](super::ObjectStore::touch) and
//! [`ObjectStore::verify_current`](super::ObjectStore::verify_current)).

use std::sync::Arc;

use super::error::HandleRefusal;
use super::index::StoreRole;
use super::object::{
    CountRead, ObjectFrame, ObjectViews, check_object, read_object, read_object_viewed,
};
use super::store_segment::StoreSegment;
use crate::error::Result;

/// A handle as a request brings it back to a reader: the object's `(address, id)`, the key
/// it was stored under and the signature the writer made for them
/// ([`ObjectStore::signature`](super::ObjectStore::signature), Python's
/// `get_signature(key)`). `None`: not given (refused with
/// [`StoreError::BadSignature`](super::StoreError::BadSignature)`{ missing: true, .. }`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SignedHandle<'a> {
    pub key: Option<&'a str>,
    pub address: u64,
    pub id: u32,
    pub signature: Option<&'a [u8]>,
}

impl<'a> SignedHandle<'a> {
    /// A handle with its key and signature, both given.
    pub fn new(key: &'a str, address: u64, id: u32, signature: &'a [u8]) -> SignedHandle<'a> {
        SignedHandle {
            key: Some(key),
            address,
            id,
            signature: Some(signature),
        }
    }

    /// A reader's check: the key and the signature are both given, and the signature is
    /// the one `segment`'s secret makes for this key, address and id (compared in
    /// constant time). Reads nothing at the address.
    ///
    /// # Errors
    /// [`StoreError::BadSignature`](super::StoreError::BadSignature): `missing: true` with
    /// [`HandleRefusal::NoKeyNoSignature`], [`HandleRefusal::NoKeyForSignature`] or
    /// [`HandleRefusal::NoSignature`] when something is not given; `missing: false` with
    /// [`HandleRefusal::Mismatch`] when the signature was made for another key or object,
    /// or by another store.
    pub fn verify(&self, segment: &StoreSegment) -> Result<()> {
        let (key, signature) = key_and_signature(self.key, self.signature)?;
        segment.verify(key, self.address, self.id, signature)
    }

    /// [`verify`](Self::verify) where `role` checks signatures (a reader); nothing for
    /// the writer, which made its handles itself.
    ///
    /// # Errors
    /// As [`verify`](Self::verify), on a role that checks.
    fn admit(&self, segment: &StoreSegment, role: StoreRole) -> Result<()> {
        if role.checks_signatures() {
            self.verify(segment)?;
        }
        Ok(())
    }
}

/// What a reader needs besides a handle to check it: the key and the signature, both
/// given; the refusal of what is missing otherwise (each is
/// [`HandleRefusal::is_missing`]). Generic, so that a binding applies the rule to its
/// own arguments before converting them (and so refuses a missing signature before it
/// looks at what else is wrong).
///
/// # Errors
/// [`HandleRefusal::NoKeyNoSignature`], [`HandleRefusal::NoKeyForSignature`] or
/// [`HandleRefusal::NoSignature`].
pub fn key_and_signature<K, S>(
    key: Option<K>,
    signature: Option<S>,
) -> std::result::Result<(K, S), HandleRefusal> {
    match (key, signature) {
        (Some(key), Some(signature)) => Ok((key, signature)),
        (None, None) => Err(HandleRefusal::NoKeyNoSignature),
        (None, Some(_)) => Err(HandleRefusal::NoKeyForSignature),
        (Some(_), None) => Err(HandleRefusal::NoSignature),
    }
}

/// A get of `handle`'s object by a process of role `role`: where the role checks
/// signatures (a reader), [`SignedHandle::verify`] first, before anything at the address
/// is read; then [`read_object`] (`count`, `f` as there). The writer reads its own handles
/// unchecked (their key and signature are ignored).
///
/// # Errors
/// The refusals of [`SignedHandle::verify`] (on a reader), then [`read_object`]'s: a
/// handle that names no live object is
/// [`StoreError::StaleObject`](super::StoreError::StaleObject).
pub fn read_signed<R>(
    segment: &StoreSegment,
    role: StoreRole,
    handle: SignedHandle<'_>,
    count: impl Into<CountRead>,
    f: impl FnOnce(&ObjectFrame<'_>) -> R,
) -> Result<R> {
    handle.admit(segment, role)?;
    read_object(segment, handle.address, handle.id, count, f)
}

/// [`read_signed`] with [`read_object_viewed`]'s private views of parts.
///
/// # Errors
/// As [`read_signed`].
pub fn read_signed_viewed<R>(
    segment: &Arc<StoreSegment>,
    role: StoreRole,
    handle: SignedHandle<'_>,
    count: impl Into<CountRead>,
    f: impl FnOnce(&ObjectFrame<'_>, &ObjectViews<'_>) -> R,
) -> Result<R> {
    handle.admit(segment, role)?;
    read_object_viewed(segment, handle.address, handle.id, count, f)
}

/// A reader's `touch`: [`SignedHandle::verify`], then that the handle still names a live
/// object ([`check_object`]). The writer's touch is
/// [`ObjectStore::touch`](super::ObjectStore::touch); a writer that counts its own reads
/// checks instead that the handle is the key's current object
/// ([`ObjectStore::current`](super::ObjectStore::current)), then calls this.
///
/// # Errors
/// The refusals of [`SignedHandle::verify`], then
/// [`StoreError::StaleObject`](super::StoreError::StaleObject) for an object evicted or
/// reused since.
pub fn check_signed(segment: &StoreSegment, handle: SignedHandle<'_>) -> Result<()> {
    handle.verify(segment)?;
    check_object(segment, handle.address, handle.id)
}
