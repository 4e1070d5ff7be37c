//! MoonBright's error type: one enum for everything an allocator call can refuse, each variant
//! saying why in words a user can act on.

use crate::driver::DriverError;

/// Everything that can go wrong in an allocator call.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Error {
    /// Not enough free memory, counting every free page wherever it is; or the driver itself
    /// refused the memory or mapping (`driver`), with room left under the cap.
    #[error("{}", out_of_memory_text(*requested, *allocated, *reserved, *free_in_pool, *cap, *short, driver.as_ref()))]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes in live allocations (as requested).
        allocated: u64,
        /// Bytes of physical memory held.
        reserved: u64,
        /// Bytes of held physical memory that no allocation uses.
        free_in_pool: u64,
        /// The cap on reserved bytes.
        cap: u64,
        /// How many more bytes would have to be free for this request to succeed.
        short: u64,
        /// The driver's refusal, when a call of the request's own failed for lack of memory:
        /// the device had no room (memory held outside MoonBright counts against it) or the
        /// driver ran out of its own resources for a mapping. MoonBright's books alone then
        /// cannot say how much must be freed.
        driver: Option<DriverError>,
    },
    /// A request that no allocator state could satisfy.
    #[error(
        "cannot allocate {}: larger than the cap of {} (option `cap`)",
        human_bytes(*requested),
        human_bytes(*cap)
    )]
    TooLarge {
        /// Bytes asked for.
        requested: u64,
        /// The cap.
        cap: u64,
    },
    /// `malloc(0)`.
    #[error("cannot allocate 0 bytes")]
    ZeroSize,
    /// A free (or `record_stream`) of an address this allocator never returned, or returned and
    /// freed already.
    #[error("unknown pointer {ptr:#x}: this allocator did not return it, or it was freed already")]
    UnknownPointer {
        /// The pointer passed.
        ptr: u64,
    },
    /// A second free of a pointer.
    #[error("double free of {ptr:#x}: it was freed already and not allocated again since")]
    DoubleFree {
        /// The pointer passed.
        ptr: u64,
    },
    /// A free (or `record_stream`) of an address inside a live allocation rather than at its
    /// start.
    #[error(
        "{ptr:#x} points {offset} bytes into the live allocation at {base:#x}: free and \
         record_stream take the pointer that malloc returned"
    )]
    InteriorPointer {
        /// The pointer passed.
        ptr: u64,
        /// The allocation it points into.
        base: u64,
        /// Its offset there.
        offset: u64,
    },
    /// A resize or release of a pointer that is not a growable allocation.
    #[error("{ptr:#x} is not a growable allocation (reserve one with reserve_growable)")]
    NotGrowable {
        /// The pointer passed.
        ptr: u64,
    },
    /// A resize or release of a growable allocation already released.
    #[error("growable allocation {ptr:#x} was released; it cannot be used any more")]
    Released {
        /// The pointer passed.
        ptr: u64,
    },
    /// A resize beyond the capacity reserved.
    #[error(
        "cannot grow {ptr:#x} to {requested} bytes: its reserved capacity is {capacity} bytes"
    )]
    BeyondCapacity {
        /// The growable allocation.
        ptr: u64,
        /// Bytes asked for.
        requested: u64,
        /// Its capacity.
        capacity: u64,
    },
    /// `record_stream` on a growable allocation.
    #[error(
        "record_stream({ptr:#x}): a growable allocation does not track other streams' uses; order \
         their work before the stream that resizes or frees it (an event and a wait)"
    )]
    GrowableStreamUse {
        /// The pointer passed.
        ptr: u64,
    },
    /// A bad option value.
    #[error("invalid option `{name}`: {reason}")]
    InvalidOption {
        /// The option's name.
        name: &'static str,
        /// What is wrong and what is allowed.
        reason: String,
    },
    /// No backend could be opened.
    #[error("no backend available: {0}")]
    NoBackend(String),
    /// The virtual address space limit was reached.
    #[error(
        "virtual address space exhausted: {reserved} bytes reserved, limit {limit} bytes \
         (option `va_limit_factor`)"
    )]
    AddressSpaceExhausted {
        /// Bytes of virtual addresses reserved.
        reserved: u64,
        /// The limit.
        limit: u64,
    },
    /// A stream-ordered request on a stream being captured into a CUDA graph, for a capture
    /// that was not begun into a graph pool.
    #[error(
        "stream {stream:#x} is being captured into a CUDA graph, and no graph pool was begun for \
         this capture: MoonBright refuses to allocate or free on it (the addresses would be baked \
         into the graph while the memory could be reused). Begin the capture into a pool \
         (begin_graph_capture; moonbright.torch.enable() does it for torch.cuda.graph), or \
         allocate before capture begins and free after the graph's last replay"
    )]
    StreamCapture {
        /// The stream.
        stream: u64,
    },
    /// A graph-pool call that does not match the captures and pools in progress.
    #[error("graph pool: {reason}")]
    GraphPool {
        /// What does not match.
        reason: String,
    },
    /// An export or import of memory shared with another process (module `ipc`) was refused.
    #[error("inter-process sharing: {0}")]
    Ipc(String),
    /// An allocation into, or a free of an allocation of, a tag that is asleep (or on its way
    /// to sleep or back): wake the tag first (`Allocator::wake`).
    #[error("tag {tag:?} is asleep: {what} must wait until it is woken (wake it first)")]
    TagAsleep {
        /// The tag's name.
        tag: String,
        /// What was refused.
        what: &'static str,
    },
    /// A sleep of a tag asleep already, or a wake of a tag that is awake.
    #[error("tag {tag:?}: {reason}")]
    TagState {
        /// The tag's name.
        tag: String,
        /// What does not match.
        reason: String,
    },
    /// A bad argument that no other variant names.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A driver call failed; the allocator's state is as it was before the request.
    #[error("driver call failed: {0}")]
    Driver(#[from] DriverError),
}

/// Result of an allocator call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `Error::OutOfMemory`'s text: what was asked, what is in use, held, free and the cap, in
/// human units with the exact bytes beside them; and the driver's refusal when there was one.
fn out_of_memory_text(
    requested: u64,
    allocated: u64,
    reserved: u64,
    free_in_pool: u64,
    cap: u64,
    short: u64,
    driver: Option<&DriverError>,
) -> String {
    let h = human_bytes;
    let books = format!(
        "{} allocated (in use), {} reserved (held), of which {} free; the cap is {}",
        h(allocated),
        h(reserved),
        h(free_in_pool),
        h(cap)
    );
    match driver {
        None => format!(
            "out of memory: tried to allocate {}; {books}. {} more must be freed for this \
             request to succeed, or the cap raised (option `cap`)",
            h(requested),
            h(short)
        ),
        Some(d) => format!(
            "out of memory: tried to allocate {} and the driver refused: {d}; {books}. The \
             device itself had no room for it (memory held outside MoonBright counts against \
             it) or the driver ran out of its own resources for the mapping",
            h(requested)
        ),
    }
}

/// A byte count for people: in the largest binary unit it reaches, with two decimals, and the
/// exact count in parentheses ("1.50 GiB (1610612736 bytes)"); below 1 KiB just the bytes.
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [(&str, u64); 4] =
        [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    match UNITS.iter().find(|(_, size)| n >= *size) {
        Some((unit, size)) => format!("{:.2} {unit} ({n} bytes)", n as f64 / *size as f64),
        None if n == 1 => "1 byte".into(),
        None => format!("{n} bytes"),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_gives_the_unit_and_the_exact_count() {
        assert_eq!(human_bytes(0), "0 bytes");
        assert_eq!(human_bytes(1), "1 byte");
        assert_eq!(human_bytes(1023), "1023 bytes");
        assert_eq!(human_bytes(1024), "1.00 KiB (1024 bytes)");
        assert_eq!(human_bytes(3 << 19), "1.50 MiB (1572864 bytes)");
        assert_eq!(human_bytes(80 << 30), "80.00 GiB (85899345920 bytes)");
        assert_eq!(human_bytes(5 << 40), "5.00 TiB (5497558138880 bytes)");
    }

    #[test]
    fn out_of_memory_says_asked_in_use_held_free_and_cap() {
        let e = Error::OutOfMemory {
            requested: 20 << 20,
            allocated: 3 << 29,
            reserved: 7 << 28,
            free_in_pool: 256 << 20,
            cap: 2 << 30,
            short: 4 << 20,
            driver: None,
        };
        assert_eq!(
            e.to_string(),
            "out of memory: tried to allocate 20.00 MiB (20971520 bytes); 1.50 GiB (1610612736 \
             bytes) allocated (in use), 1.75 GiB (1879048192 bytes) reserved (held), of which \
             256.00 MiB (268435456 bytes) free; the cap is 2.00 GiB (2147483648 bytes). 4.00 MiB \
             (4194304 bytes) more must be freed for this request to succeed, or the cap raised \
             (option `cap`)"
        );
        let e = Error::TooLarge { requested: 3 << 30, cap: 1 << 30 };
        assert_eq!(
            e.to_string(),
            "cannot allocate 3.00 GiB (3221225472 bytes): larger than the cap of 1.00 GiB \
             (1073741824 bytes) (option `cap`)"
        );
    }
}
