//! Typed arrays: the message format both languages speak for numbers.
//!
//! An array message is a message of two parts (see `super::framing`, whose descriptor
//! block says "array" by its magic, never by guessing from the bytes): a small header
//! that says what the numbers are, and the data, which travels as any other part does
//! (small: copied into the chunk; large: through the tensor arena, or a ZeroMQ frame for a
//! remote reader), so a large array reaches every reader with no copy.
//!
//! A Rust writer sends one with [`Writer::enqueue`](super::Writer::enqueue) (an
//! [`ArrayRef`], [`ArrayRef::new`] from a typed slice and a shape); a Python writer with
//! `MessageQueue.enqueue_array(a)` (a numpy array or a CPU torch tensor). A Rust reader
//! takes it with [`Reader::dequeue_array`](super::Reader::dequeue_array) ([`Array`]: its
//! dtype, shape, strides, and the data as a typed slice, [`Array::as_slice`]); a Python
//! reader with `dequeue()` (a numpy array) or `dequeue_array(kind=...)` (numpy, torch or
//! a typed memoryview), with no copy for parts in the arena or in a frame.
//!
//! ```text
//! header, little-endian:
//! 0   magic: u32 = "SQAH"    4  dtype: u32 (Dtype's code)    8  ndim: u32   12  0: u32
//! 16  shape: ndim × u64      ..  strides in bytes: ndim × i64
//! ```
//! A reader checks every field against the data it got: a known dtype, at most
//! [`MAX_NDIM`] dimensions, no overflow in the element count, strides non-negative and
//! keeping every element inside the data. Anything else is an error naming the field.

use std::fmt;

use super::queue::OwnedPart;
use crate::error::{Error, Result};

const MAGIC: u32 = u32::from_le_bytes(*b"SQAH");
/// The most dimensions an array message may have (numpy's limit is 64).
pub const MAX_NDIM: usize = 64;

/// What an array's elements are. The discriminants are the wire format's codes (never
/// changed; a new dtype takes the next one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u32)]
pub enum Dtype {
    Bool = 1,
    U8 = 2,
    I8 = 3,
    U16 = 4,
    I16 = 5,
    U32 = 6,
    I32 = 7,
    U64 = 8,
    I64 = 9,
    F16 = 10,
    BF16 = 11,
    F32 = 12,
    F64 = 13,
}

const ALL: [Dtype; 13] = [
    Dtype::Bool,
    Dtype::U8,
    Dtype::I8,
    Dtype::U16,
    Dtype::I16,
    Dtype::U32,
    Dtype::I32,
    Dtype::U64,
    Dtype::I64,
    Dtype::F16,
    Dtype::BF16,
    Dtype::F32,
    Dtype::F64,
];

impl Dtype {
    /// The code on the wire.
    pub fn code(self) -> u32 {
        ALL.iter()
            .position(|&d| d == self)
            .expect("every dtype is in ALL") as u32
            + 1
    }

    /// The dtype of a wire code, if it is one.
    pub fn from_code(code: u32) -> Option<Dtype> {
        (code as usize)
            .checked_sub(1)
            .and_then(|i| ALL.get(i).copied())
    }

    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// The name both languages use: numpy's and torch's (`"float32"`, `"bfloat16"`...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::I8 => "int8",
            Dtype::U16 => "uint16",
            Dtype::I16 => "int16",
            Dtype::U32 => "uint32",
            Dtype::I32 => "int32",
            Dtype::U64 => "uint64",
            Dtype::I64 => "int64",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
        }
    }

    /// The dtype named `name` (see [`name`](Self::name)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the dtypes an array message carries, when `name`
    /// is none of them.
    pub fn from_name(name: &str) -> Result<Dtype> {
        ALL.iter()
            .copied()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = ALL.iter().map(|d| d.name()).collect();
                Error::InvalidArgument(format!(
                    "an array message cannot carry dtype {name:?}: one of {} (little-endian)",
                    names.join(", ")
                ))
            })
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust element type with a [`Dtype`]: the numbers an [`Array`] can be read as, and an
/// [`ArrayRef`] made of. (`bool` is not one: a bool array's bytes read as `u8`, 0 or 1.)
pub trait Element: bytemuck::Pod {
    const DTYPE: Dtype;
}

macro_rules! elements {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl Element for $t {
            const DTYPE: Dtype = Dtype::$d;
        }
    )*};
}
elements!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64,
    i64 => I64, f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => BF16,
);

/// What an array is: its dtype, shape and strides (in bytes, one per dimension).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrayMeta {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl ArrayMeta {
    /// A C-contiguous (row-major) array of `shape`.
    pub fn contiguous(dtype: Dtype, shape: &[usize]) -> ArrayMeta {
        let mut strides = vec![0; shape.len()];
        let mut step = dtype.itemsize();
        for (s, &n) in strides.iter_mut().zip(shape).rev() {
            *s = step;
            step = step.saturating_mul(n);
        }
        ArrayMeta {
            dtype,
            shape: shape.to_vec(),
            strides,
        }
    }

    /// How many elements; `None` on overflow.
    pub fn len(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |a, &n| a.checked_mul(n))
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.shape.contains(&0)
    }

    /// Whether the elements lie in row-major order with no gaps.
    pub fn is_contiguous(&self) -> bool {
        self.is_empty() || *self == ArrayMeta::contiguous(self.dtype, &self.shape)
    }

    /// The bytes of data the array reaches (one past its last element), checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] ("malformed array message") for more than [`MAX_NDIM`]
    /// dimensions, a stride count other than the shape's, or a span that overflows `usize`.
    pub fn span(&self) -> Result<usize> {
        let bad = |why: String| Error::InvalidArgument(format!("malformed array message: {why}"));
        if self.shape.len() > MAX_NDIM || self.strides.len() != self.shape.len() {
            return Err(bad(format!(
                "{} dimensions and {} strides (at most {MAX_NDIM}, one stride each)",
                self.shape.len(),
                self.strides.len()
            )));
        }
        if self
            .len()
            .and_then(|n| n.checked_mul(self.dtype.itemsize()))
            .is_none()
        {
            return Err(bad(format!("shape {:?} overflows", self.shape)));
        }
        if self.is_empty() {
            return Ok(0);
        }
        let last = self
            .shape
            .iter()
            .zip(&self.strides)
            .try_fold(0usize, |a, (&n, &s)| {
                (n - 1).checked_mul(s).and_then(|x| a.checked_add(x))
            })
            .and_then(|a| a.checked_add(self.dtype.itemsize()))
            .ok_or_else(|| bad(format!("strides {:?} overflow", self.strides)))?;
        Ok(last)
    }

    /// The header bytes for these fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 16 * self.shape.len());
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&self.dtype.code().to_le_bytes());
        out.extend_from_slice(&(self.shape.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for &n in &self.shape {
            out.extend_from_slice(&(n as u64).to_le_bytes());
        }
        for &s in &self.strides {
            out.extend_from_slice(&(s as u64).to_le_bytes());
        }
        out
    }

    /// The fields of a header, checked against `data_len` bytes of data.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] ("malformed array message") for a header without the
    /// array magic, an unknown dtype, a truncated shape or strides, or elements that reach
    /// past `data_len`.
    pub fn decode(header: &[u8], data_len: usize) -> Result<ArrayMeta> {
        let bad = |why: &str| Error::InvalidArgument(format!("malformed array message: {why}"));
        let u32_at =
            |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4 bytes"));
        if header.len() < 16 || u32_at(0) != MAGIC {
            return Err(bad("no array header"));
        }
        let dtype = Dtype::from_code(u32_at(4)).ok_or_else(|| bad("an unknown dtype"))?;
        let ndim = u32_at(8) as usize;
        if ndim > MAX_NDIM || header.len() != 16 + 16 * ndim {
            return Err(bad("a bad number of dimensions"));
        }
        let words = |from: usize| -> Result<Vec<usize>> {
            (0..ndim)
                .map(|i| {
                    let at = from + 8 * i;
                    let v = u64::from_le_bytes(header[at..at + 8].try_into().expect("8 bytes"));
                    usize::try_from(v)
                        .ok()
                        .filter(|&v| v <= isize::MAX as usize)
                })
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| bad("a shape or stride out of range"))
        };
        let meta = ArrayMeta {
            dtype,
            shape: words(16)?,
            strides: words(16 + 8 * ndim)?,
        };
        let span = meta.span()?;
        if span > data_len {
            return Err(bad(&format!(
                "its elements reach byte {span} of {data_len} bytes of data"
            )));
        }
        Ok(meta)
    }
}

/// An array to send: its fields and its bytes, borrowed (see the module docs).
#[derive(Clone, Debug)]
pub struct ArrayRef<'a> {
    meta: ArrayMeta,
    data: &'a [u8],
}

impl<'a> ArrayRef<'a> {
    /// The C-contiguous array of `shape` whose elements are `data` (as many as the shape
    /// says).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `data` holds another number of elements than `shape`
    /// says, or a dimension is past `2**63 - 1`.
    pub fn new<T: Element>(data: &'a [T], shape: &[usize]) -> Result<ArrayRef<'a>> {
        ArrayRef::from_bytes(T::DTYPE, shape, bytemuck::cast_slice(data))
    }

    /// The C-contiguous array of `shape` and `dtype` whose bytes (little-endian) are
    /// `data`: exactly as many as the shape says.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `data` holds another number of bytes than `shape` of
    /// `dtype` takes, or a dimension is past `2**63 - 1`.
    pub fn from_bytes(dtype: Dtype, shape: &[usize], data: &'a [u8]) -> Result<ArrayRef<'a>> {
        ArrayRef::with_strides(ArrayMeta::contiguous(dtype, shape), data)
    }

    /// The array `meta` says, in `data` (strides in bytes; every element inside `data`).
    /// Refused as a reader's [`ArrayMeta::decode`] would refuse it, so that no writer
    /// sends an array no reader can take: a dimension or a stride past `2**63 - 1` (an
    /// empty array's too: shape `(0, 2**60)` of float64 has a stride of `2**63` bytes).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a dimension or stride past `2**63 - 1`, more than
    /// [`MAX_NDIM`] dimensions, or an element outside `data`.
    pub fn with_strides(meta: ArrayMeta, data: &'a [u8]) -> Result<ArrayRef<'a>> {
        let too_large = |&v: &usize| v > isize::MAX as usize;
        let (what, v) = match (
            meta.shape.iter().find(|v| too_large(v)),
            meta.strides.iter().find(|v| too_large(v)),
        ) {
            (Some(&n), _) => ("a dimension of", n),
            (None, Some(&s)) => ("a stride (in bytes) of", s),
            (None, None) => ("", 0),
        };
        if !what.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "an array of shape {:?} and dtype {} cannot be sent: it has {what} {v}, past \
                 2**63 - 1, which no reader takes (an empty array too: its strides follow \
                 from its shape)",
                meta.shape, meta.dtype
            )));
        }
        let span = meta.span()?;
        let exact = !meta.is_contiguous() || span == data.len();
        if span > data.len() || !exact {
            return Err(Error::InvalidArgument(format!(
                "an array of shape {:?} and dtype {} needs {span} bytes of data, got {}",
                meta.shape,
                meta.dtype,
                data.len()
            )));
        }
        Ok(ArrayRef { meta, data })
    }

    pub fn meta(&self) -> &ArrayMeta {
        &self.meta
    }

    pub fn data(&self) -> &'a [u8] {
        self.data
    }
}

/// An array as a reader takes it ([`Reader::dequeue_array`](super::Reader::dequeue_array)):
/// its fields, and its data, owned (a copy for a small one, a private view of the tensor
/// arena or a ZeroMQ frame for a large one: no copy).
#[derive(Debug)]
pub struct Array {
    meta: ArrayMeta,
    data: OwnedPart,
}

impl Array {
    pub(crate) fn new(meta: ArrayMeta, data: OwnedPart) -> Array {
        Array { meta, data }
    }

    pub fn meta(&self) -> &ArrayMeta {
        &self.meta
    }

    pub fn dtype(&self) -> Dtype {
        self.meta.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.meta.shape
    }

    /// In bytes, one per dimension.
    pub fn strides(&self) -> &[usize] {
        &self.meta.strides
    }

    /// The data's bytes (for a strided array, every byte its elements lie in).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The elements as a slice of `T`, in row-major order, with no copy. An error if `T`
    /// is not the array's dtype, the array is not C-contiguous, or its bytes are not
    /// aligned for `T` here (then [`to_vec`](Self::to_vec) copies).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `T` is not the array's dtype, the array is not
    /// C-contiguous, or its bytes are not aligned for `T` (read it with
    /// [`to_vec`](Self::to_vec) then).
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check::<T>()?;
        if !self.meta.is_contiguous() {
            return Err(Error::InvalidArgument(format!(
                "this array is not C-contiguous (strides {:?}): read it with to_vec",
                self.meta.strides
            )));
        }
        let n = self.meta.len().expect("checked when received") * self.meta.dtype.itemsize();
        bytemuck::try_cast_slice(&self.data[..n]).map_err(|e| {
            Error::InvalidArgument(format!(
                "the array's bytes cannot be read as {} in place ({e}): read it with to_vec",
                self.meta.dtype
            ))
        })
    }

    /// The elements as a new vector of `T`, in row-major order (any strides, any
    /// alignment). An error if `T` is not the array's dtype.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `T` is not the array's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check::<T>()?;
        let n = self.meta.len().expect("checked when received");
        let size = std::mem::size_of::<T>();
        let mut out = Vec::with_capacity(n);
        let mut index = vec![0usize; self.meta.shape.len()];
        for _ in 0..n {
            let at: usize = index
                .iter()
                .zip(&self.meta.strides)
                .map(|(i, s)| i * s)
                .sum();
            out.push(bytemuck::pod_read_unaligned(&self.data[at..at + size]));
            // The next index in row-major order.
            for d in (0..index.len()).rev() {
                index[d] += 1;
                if index[d] < self.meta.shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Ok(out)
    }

    /// The fields and the owned data.
    pub fn into_parts(self) -> (ArrayMeta, OwnedPart) {
        (self.meta, self.data)
    }

    fn check<T: Element>(&self) -> Result<()> {
        let wanted = if self.meta.dtype == Dtype::Bool {
            Dtype::U8
        } else {
            self.meta.dtype
        };
        if T::DTYPE != wanted {
            return Err(Error::InvalidArgument(format!(
                "this array's dtype is {}, not {}",
                self.meta.dtype,
                T::DTYPE
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_hostile_headers() {
        let meta = ArrayMeta::contiguous(Dtype::F32, &[2, 3]);
        assert_eq!(meta.strides, [12, 4]);
        let h = meta.encode();
        assert_eq!(ArrayMeta::decode(&h, 24).unwrap(), meta);
        assert!(ArrayMeta::decode(&h, 23).is_err(), "data too short");
        for len in 0..h.len() {
            assert!(ArrayMeta::decode(&h[..len], 24).is_err());
        }
        let mut b = h.clone();
        b[4] = 99;
        assert!(ArrayMeta::decode(&b, 24).is_err(), "unknown dtype");
        let mut b = h.clone();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(ArrayMeta::decode(&b, 24).is_err(), "shape out of range");
        let huge = ArrayMeta {
            dtype: Dtype::F64,
            shape: vec![1 << 40, 1 << 40],
            strides: vec![8, 8],
        };
        assert!(
            ArrayMeta::decode(&huge.encode(), 1 << 20).is_err(),
            "overflow"
        );
        let empty = ArrayMeta::contiguous(Dtype::I64, &[0, 5]);
        assert_eq!(ArrayMeta::decode(&empty.encode(), 0).unwrap(), empty);
    }

    #[test]
    fn dtypes_by_code_and_name() {
        for d in ALL {
            assert_eq!(Dtype::from_code(d.code()), Some(d));
            assert_eq!(Dtype::from_name(d.name()).unwrap(), d);
        }
        assert_eq!(Dtype::from_code(0), None);
        assert!(Dtype::from_name("complex64").is_err());
    }

    #[test]
    fn typed_reads() {
        let v: Vec<i32> = (0..6).collect();
        let sent = ArrayRef::new(&v, &[2, 3]).unwrap();
        assert!(ArrayRef::new(&v, &[4, 2]).is_err());
        let a = Array::new(sent.meta().clone(), OwnedPart::Copied(sent.data().to_vec()));
        assert_eq!(a.to_vec::<i32>().unwrap(), v);
        assert!(a.to_vec::<f32>().is_err());
        // Transposed: strides (4, 12) over the same bytes.
        let t = Array::new(
            ArrayMeta {
                dtype: Dtype::I32,
                shape: vec![3, 2],
                strides: vec![4, 12],
            },
            OwnedPart::Copied(sent.data().to_vec()),
        );
        assert_eq!(t.to_vec::<i32>().unwrap(), [0, 3, 1, 4, 2, 5]);
        assert!(t.as_slice::<i32>().is_err());
    }

    /// Issue 44: what a writer may send, every reader takes. An empty array of float64
    /// and shape (0, 2**60) was sent (its first stride, 2**63 bytes, saturated past
    /// what a header may hold) and every reader refused it as malformed.
    #[test]
    fn what_a_writer_may_send_a_reader_takes() {
        for (dtype, shape) in [
            (Dtype::F64, vec![0, 1 << 60]),
            (Dtype::U8, vec![0, 1 << 63]),
            (Dtype::F32, vec![0, 1 << 62, 4]),
            (Dtype::I64, vec![0, usize::MAX]),
        ] {
            let meta = ArrayMeta::contiguous(dtype, &shape);
            let err = ArrayRef::with_strides(meta.clone(), &[]).unwrap_err();
            assert!(err.to_string().contains("cannot be sent"), "{err}");
            assert!(ArrayMeta::decode(&meta.encode(), 0).is_err(), "{shape:?}");
        }
        for (dtype, shape) in [
            (Dtype::F32, vec![0, 1 << 60]),
            (Dtype::U8, vec![0, 1 << 62]),
            (Dtype::F64, vec![1 << 59, 0]),
            (Dtype::F64, vec![0]),
            (Dtype::I32, vec![]),
        ] {
            let meta = ArrayMeta::contiguous(dtype, &shape);
            let n = meta.span().unwrap();
            let data = vec![0u8; n];
            let sent = ArrayRef::with_strides(meta.clone(), &data).unwrap();
            assert_eq!(ArrayMeta::decode(&sent.meta().encode(), n).unwrap(), meta);
        }
    }
}
