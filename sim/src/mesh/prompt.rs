//! A request's prompt tokens, shared rather than copied ([`SimPrompt`]).

use kvmesh_common::{BlockHash, BlockHasher, PromptHashes, TokenId};
use std::sync::{Arc, Mutex, OnceLock};

/// A request's prompt tokens, shared rather than copied. A multiplied trace
/// ([`crate::workload::multiply`]) holds tens of thousands of prompts of thousands of tokens
/// each, and its copies differ from the original only in their first token: every copy
/// shares the original's buffers and keeps its own first token apart. When a request arrives
/// the mesh takes one of those buffers that no live request holds and writes the request's
/// first token into it ([`SimPrompt::tokens`]): the router, the decode node and the prefill
/// node share it, and it is free again when the request has ended and they have let it go.
/// Copies of a prompt are spread over the trace's span, so they seldom overlap: most prompts
/// keep one buffer, and an arrival copies nothing.
#[derive(Clone, Debug)]
pub struct SimPrompt {
    shared: Arc<Shared>,
    first: TokenId,
}

/// What every copy of a prompt shares.
#[derive(Debug)]
struct Shared {
    /// The tokens, each buffer with the first token of the copy that took it last. The first
    /// buffer is never dropped (its tokens but the first are read from it).
    buffers: Mutex<Vec<Arc<[TokenId]>>>,
    len: usize,
    /// The last token, when the prompt has more than one.
    last: Option<TokenId>,
    /// The hashes of the full blocks but the first (which holds the first token), made once
    /// for every copy ([`SimPrompt::hashes`]).
    later_blocks: OnceLock<LaterBlocks>,
}

/// A shared buffer's block hashes after its first block, and the hasher that made them.
#[derive(Debug)]
struct LaterBlocks {
    hasher: BlockHasher,
    hashes: Vec<BlockHash>,
}

impl SimPrompt {
    fn new(tokens: Arc<[TokenId]>) -> SimPrompt {
        SimPrompt {
            first: tokens.first().copied().unwrap_or_default(),
            shared: Arc::new(Shared {
                len: tokens.len(),
                last: (tokens.len() > 1).then(|| tokens[tokens.len() - 1]),
                buffers: Mutex::new(vec![tokens]),
                later_blocks: OnceLock::new(),
            }),
        }
    }

    pub fn len(&self) -> usize {
        self.shared.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn first(&self) -> Option<TokenId> {
        (!self.is_empty()).then_some(self.first)
    }

    pub fn last(&self) -> Option<TokenId> {
        self.shared.last.or(self.first())
    }

    /// The same prompt but for its first token, which becomes `first` (sharing the buffers).
    pub fn with_first(&self, first: TokenId) -> SimPrompt {
        SimPrompt {
            shared: self.shared.clone(),
            first,
        }
    }

    /// `hasher`'s hashes of this prompt, whose tokens are `tokens` ([`SimPrompt::tokens`]):
    /// its first block hashed, every later one's hash shared with the prompts that share its
    /// buffers (a multiplied trace's copies differ only in their first token).
    pub fn hashes(&self, hasher: BlockHasher, tokens: &[TokenId]) -> PromptHashes {
        debug_assert_eq!(tokens.len(), self.len());
        let bs = hasher.block_size;
        if tokens.len() < bs {
            return PromptHashes::new(hasher, tokens);
        }
        let later = self.shared.later_blocks.get_or_init(|| LaterBlocks {
            hasher,
            hashes: tokens[bs..]
                .chunks_exact(bs)
                .map(|b| hasher.block_hash(b))
                .collect(),
        });
        if later.hasher != hasher {
            return PromptHashes::new(hasher, tokens);
        }
        let first = hasher.block_hash(&tokens[..bs]);
        PromptHashes::from_blocks(
            hasher,
            std::iter::once(first).chain(later.hashes.iter().copied()),
        )
    }

    /// The tokens, in one buffer that nothing else uses while the caller holds it: a shared
    /// buffer no live request holds, with this prompt's first token written in; a copy only
    /// when every buffer is held.
    pub fn tokens(&self) -> Arc<[TokenId]> {
        let mut buffers = self.shared.buffers.lock().expect("prompt buffers");
        let free = buffers.iter_mut().position(|b| Arc::get_mut(b).is_some());
        let at = free.unwrap_or_else(|| {
            let copy = Arc::from(&buffers[0][..]);
            buffers.push(copy);
            buffers.len() - 1
        });
        let buffer = &mut buffers[at];
        if let Some(first) = Arc::get_mut(buffer).and_then(|t| t.first_mut()) {
            *first = self.first;
        }
        buffer.clone()
    }

    pub fn to_vec(&self) -> Vec<TokenId> {
        self.tokens().to_vec()
    }

    /// Whether `other` has the same tokens but for the first.
    fn same_rest(&self, other: &SimPrompt) -> bool {
        if Arc::ptr_eq(&self.shared, &other.shared) {
            return true;
        }
        let a = self.shared.buffers.lock().expect("prompt buffers");
        let b = other.shared.buffers.lock().expect("prompt buffers");
        a[0][1..] == b[0][1..]
    }
}

impl From<Vec<TokenId>> for SimPrompt {
    fn from(tokens: Vec<TokenId>) -> SimPrompt {
        SimPrompt::new(tokens.into())
    }
}

impl From<&[TokenId]> for SimPrompt {
    /// One copy, straight into the shared buffer.
    fn from(tokens: &[TokenId]) -> SimPrompt {
        SimPrompt::new(tokens.into())
    }
}

impl FromIterator<TokenId> for SimPrompt {
    fn from_iter<I: IntoIterator<Item = TokenId>>(iter: I) -> SimPrompt {
        iter.into_iter().collect::<Vec<_>>().into()
    }
}

impl PartialEq for SimPrompt {
    fn eq(&self, other: &SimPrompt) -> bool {
        self.len() == other.len()
            && (self.is_empty() || (self.first == other.first && self.same_rest(other)))
    }
}

impl Eq for SimPrompt {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_buffer_is_reused_and_a_held_one_is_never_written() {
        let original = SimPrompt::from(vec![1, 2, 3]);
        let copy = original.with_first(9);
        let held = original.tokens();
        assert_eq!(held[..], [1, 2, 3]);
        // The original's buffer is held: the copy gets a buffer of its own.
        let other = copy.tokens();
        assert_eq!(other[..], [9, 2, 3]);
        assert!(!Arc::ptr_eq(&held, &other));
        assert_eq!(held[..], [1, 2, 3], "a held buffer keeps its tokens");
        // Once let go, a buffer is taken again, with the taker's first token.
        let other_ptr = Arc::as_ptr(&other);
        drop(other);
        let again = copy.tokens();
        assert_eq!(Arc::as_ptr(&again), other_ptr);
        assert_eq!(again[..], [9, 2, 3]);
        drop((held, again));
        assert_eq!(copy.tokens()[..], [9, 2, 3]);
        assert_eq!(original.tokens()[..], [1, 2, 3]);
        assert_eq!(
            (copy.len(), copy.first(), copy.last()),
            (3, Some(9), Some(3))
        );
        assert_eq!(copy, SimPrompt::from(vec![9, 2, 3]));
        assert_ne!(copy, original);
        let one = SimPrompt::from(vec![4]).with_first(5);
        assert_eq!((one.last(), one.to_vec()), (Some(5), vec![5]));
        assert!(SimPrompt::from(Vec::new()).tokens().is_empty());
    }
}
