//! The room a queue that is given back when its connection goes idle makes
//! again at the next burst (mcp-xds-gateway's patch): the most entries it
//! held since it was last given back, up to a bound. Shared by the slabs of
//! received and queued frames (`proto::streams::buffer`) and the encoder's
//! queue of DATA frames (`codec::framed_write`).

/// A queue's last burst: its peak since it was last given back, and the
/// room its next burst makes at its first entry.
#[derive(Debug, Default)]
pub(crate) struct BurstRoom {
    peak: u32,
    room: u32,
}

impl BurstRoom {
    /// The room to make at a burst's first entry (the queue has none).
    pub(crate) fn room(&self) -> usize {
        self.room as usize
    }

    /// The queue holds `held` entries now.
    pub(crate) fn held(&mut self, held: usize) {
        self.peak = self.peak.max(u32::try_from(held).unwrap_or(u32::MAX));
    }

    /// The queue was given back: its next burst makes room for this one's
    /// peak, up to `at_most`.
    pub(crate) fn given_back(&mut self, at_most: u32) {
        self.room = self.peak.min(at_most);
        self.peak = 0;
    }
}
