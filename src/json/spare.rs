//! The buffers of a document read before, kept for the next one.
//!
//! A document of a large body takes megabytes (16 bytes a value, 24 a member: about 5 MiB for
//! a body of 1 MiB nested as deep as a body may go). Freed, blocks that large tend to go back
//! to the system, and the next document pays a page fault per 4 KiB as it touches them again:
//! as much as reading the body itself. So one set of buffers is kept for the whole process
//! (not one per thread: large bodies are read on tokio's blocking threads, which are many), and
//! only while it holds no more than [`KEPT`] bytes; a document read while the set is taken
//! (another thread's) allocates its own.

use std::sync::Mutex;

use super::order::Key;
use super::{Member, Node};

/// The most bytes of buffers kept: the documents of bodies of up to the default keyed body
/// limit (1 MiB) fit, whatever their shape.
const KEPT: usize = 16 << 20;

/// A document's buffers (empty, with their capacity).
#[derive(Default)]
pub(super) struct Buffers {
    pub items: Vec<Node>,
    pub members: Vec<Member>,
    pub decoded: Vec<u8>,
    pub verbatim: Vec<(u32, u32)>,
    pub open_items: Vec<Node>,
    pub open_members: Vec<Member>,
    pub order: Vec<Key>,
    pub order_spare: Vec<Key>,
}

impl Buffers {
    fn bytes(&self) -> usize {
        use std::mem::size_of;
        (self.items.capacity() + self.open_items.capacity()) * size_of::<Node>()
            + (self.members.capacity() + self.open_members.capacity()) * size_of::<Member>()
            + self.decoded.capacity()
            + self.verbatim.capacity() * size_of::<(u32, u32)>()
            + (self.order.capacity() + self.order_spare.capacity()) * size_of::<Key>()
    }
}

static SPARE: Mutex<Option<Buffers>> = Mutex::new(None);

/// Bodies from this size on use the kept buffers. A smaller body's document is a few small
/// blocks that the allocator's per-thread caches serve at once, and the kept set's lock
/// would be one more line that every serving core writes at every keyed request.
const FROM: usize = 64 * 1024;

/// The kept buffers for a document of a body of `len` bytes, or new ones.
pub(super) fn take(len: usize) -> Buffers {
    if len < FROM {
        return Buffers::default();
    }
    match SPARE.try_lock() {
        Ok(mut spare) => spare.take().unwrap_or_default(),
        Err(_) => Buffers::default(),
    }
}

/// Gives buffers back: `give` moves them into the kept set (emptied here), which is dropped
/// if it gets larger than [`KEPT`].
/// Only the buffers of a body of [`FROM`] bytes or more (`len`) are kept.
pub(super) fn keep(len: usize, give: impl FnOnce(&mut Buffers)) {
    if len < FROM {
        return;
    }
    let Ok(mut spare) = SPARE.try_lock() else {
        return;
    };
    let buffers = spare.get_or_insert_with(Buffers::default);
    give(buffers);
    if buffers.bytes() > KEPT {
        *spare = None;
        return;
    }
    buffers.items.clear();
    buffers.members.clear();
    buffers.decoded.clear();
    buffers.verbatim.clear();
    buffers.open_items.clear();
    buffers.open_members.clear();
    buffers.order.clear();
    buffers.order_spare.clear();
}
