//! What MoonBright's tests, benchmarks and `moonbright demo` share, and nothing a user of the
//! allocator needs: the workloads written once over any allocator ([`scenario`]), the no-remap
//! caching allocator MoonBright is compared with ([`baseline`]), and sample summaries built on
//! the one percentile ([`stats`]).

pub mod baseline;
pub mod scenario;
pub mod stats;
