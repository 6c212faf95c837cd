//! The queue of free KV blocks in eviction order; design follows vLLM v1
//! `FreeKVCacheBlockQueue`: an intrusive doubly linked list over block indices.
//!
//! ```text
//! head (evicted first)                                   tail (freed last)
//!   b5 <-> b2 <-> b9 <-> b0
//! prev[b2] = b5, next[b2] = b9; prev[head] = next[tail] = NIL
//! ```
//! Every operation is O(1), including removing a block from the middle, which a prefix hit on
//! a free cached block needs.

/// The "no block" link.
const NIL: u32 = u32::MAX;

/// Invariant: the blocks with `queued[b]` form exactly one chain from `head` to `tail`, linked
/// both ways, and `len` counts them.
#[derive(Debug)]
pub(crate) struct FreeBlockQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeBlockQueue {
    /// A queue holding every block `0..num_blocks`, in that order.
    pub(crate) fn new(num_blocks: usize) -> Self {
        assert!(
            num_blocks < NIL as usize,
            "block ids must fit below u32::MAX"
        );
        let mut queue = FreeBlockQueue {
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            queued: vec![false; num_blocks],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        (0..num_blocks as u32).for_each(|b| queue.push_back(b));
        queue
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, block: u32) -> bool {
        self.queued[block as usize]
    }

    /// Appends `block`: it will be evicted after every block already queued.
    pub(crate) fn push_back(&mut self, block: u32) {
        self.link_new(block, self.tail, NIL);
    }

    /// Prepends `block`: it will be evicted before every block already queued.
    pub(crate) fn push_front(&mut self, block: u32) {
        self.link_new(block, NIL, self.head);
    }

    /// Takes the block to evict next.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let block = self.head;
        if block == NIL {
            return None;
        }
        self.remove(block);
        Some(block)
    }

    /// Unlinks a queued block, wherever it sits.
    pub(crate) fn remove(&mut self, block: u32) {
        let b = block as usize;
        assert!(self.queued[b], "block {block} is not in the free queue");
        let (prev, next) = (self.prev[b], self.next[b]);
        match prev {
            NIL => self.head = next,
            p => self.next[p as usize] = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.prev[n as usize] = prev,
        }
        self.prev[b] = NIL;
        self.next[b] = NIL;
        self.queued[b] = false;
        self.len -= 1;
    }

    /// The queued blocks from head to tail.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(Some(self.head).filter(|&b| b != NIL), |&b| {
            Some(self.next[b as usize]).filter(|&n| n != NIL)
        })
    }

    /// Checks the links (a debug and test helper).
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut seen = 0usize;
        let mut prev = NIL;
        let mut block = self.head;
        while block != NIL {
            let b = block as usize;
            if seen >= self.len || !self.queued[b] {
                return Err(format!(
                    "free queue walks onto block {block}, which is not queued"
                ));
            }
            if self.prev[b] != prev {
                return Err(format!("free queue: prev link of block {block} is broken"));
            }
            seen += 1;
            prev = block;
            block = self.next[b];
        }
        let num_queued = self.queued.iter().filter(|&&q| q).count();
        if prev != self.tail || seen != self.len || num_queued != self.len {
            return Err(format!(
                "free queue: walked {seen} blocks, len is {}, {num_queued} marked queued",
                self.len
            ));
        }
        Ok(())
    }

    fn link_new(&mut self, block: u32, prev: u32, next: u32) {
        let b = block as usize;
        assert!(
            !self.queued[b],
            "block {block} is already in the free queue"
        );
        self.prev[b] = prev;
        self.next[b] = next;
        match prev {
            NIL => self.head = block,
            p => self.next[p as usize] = block,
        }
        match next {
            NIL => self.tail = block,
            n => self.prev[n as usize] = block,
        }
        self.queued[b] = true;
        self.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(queue: &FreeBlockQueue) -> Vec<u32> {
        queue
            .check_invariants()
            .expect("queue links are consistent");
        queue.iter().collect()
    }

    #[test]
    fn new_queue_holds_every_block_in_order() {
        let queue = FreeBlockQueue::new(4);
        assert_eq!(order(&queue), [0, 1, 2, 3]);
        assert_eq!(queue.len(), 4);
    }

    #[test]
    fn pop_front_takes_the_head_until_empty() {
        let mut queue = FreeBlockQueue::new(2);
        assert_eq!(queue.pop_front(), Some(0));
        assert_eq!(queue.pop_front(), Some(1));
        assert_eq!(queue.pop_front(), None);
        assert_eq!(order(&queue), Vec::<u32>::new());
    }

    #[test]
    fn remove_unlinks_head_middle_and_tail() {
        let mut queue = FreeBlockQueue::new(5);
        queue.remove(2);
        assert_eq!(order(&queue), [0, 1, 3, 4]);
        queue.remove(0);
        assert_eq!(order(&queue), [1, 3, 4]);
        queue.remove(4);
        assert_eq!(order(&queue), [1, 3]);
        assert!(!queue.contains(4));
        assert!(queue.contains(3));
    }

    #[test]
    fn push_back_and_push_front_place_blocks_at_the_ends() {
        let mut queue = FreeBlockQueue::new(4);
        queue.remove(1);
        queue.remove(2);
        queue.push_back(2);
        queue.push_front(1);
        assert_eq!(order(&queue), [1, 0, 3, 2]);
    }

    #[test]
    fn emptied_queue_accepts_blocks_again() {
        let mut queue = FreeBlockQueue::new(3);
        while queue.pop_front().is_some() {}
        queue.push_front(2);
        queue.push_back(0);
        assert_eq!(order(&queue), [2, 0]);
        assert_eq!(queue.len(), 2);
    }

    #[test]
    fn empty_pool_gives_an_empty_queue() {
        let mut queue = FreeBlockQueue::new(0);
        assert_eq!(queue.pop_front(), None);
        assert_eq!(order(&queue), Vec::<u32>::new());
    }
}
