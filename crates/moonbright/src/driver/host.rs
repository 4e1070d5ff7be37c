//! Placeholder: the host backend is being written.
use super::*;
/// Host backend options.
#[derive(Clone, Debug)]
pub struct HostConfig { pub page_size: usize, pub capacity: u64 }
impl Default for HostConfig { fn default() -> Self { HostConfig { page_size: 2 << 20, capacity: 64 << 30 } } }
/// Host backend.
#[derive(Debug)]
pub struct HostDriver;
impl HostDriver {
    pub fn new(_c: HostConfig) -> DriverResult<Self> { unimplemented!() }
    pub fn hold_stream(&self, _s: StreamHandle) {}
    pub fn release_stream(&self, _s: StreamHandle) {}
    pub fn resident_bytes(&self) -> u64 { 0 }
    pub fn live_chunk_bytes(&self) -> u64 { 0 }
    pub fn mapping_count(&self) -> usize { 0 }
}
impl Driver for HostDriver {
    fn name(&self) -> &'static str { "host" }
    fn granularity(&self) -> usize { unimplemented!() }
    fn mem_info(&self) -> DriverResult<MemInfo> { unimplemented!() }
    fn reserve(&self, _size: usize, _alignment: usize) -> DriverResult<DevicePtr> { unimplemented!() }
    fn free_reservation(&self, _base: DevicePtr, _size: usize) -> DriverResult<()> { unimplemented!() }
    fn create_chunk(&self, _size: usize) -> DriverResult<ChunkHandle> { unimplemented!() }
    fn release_chunk(&self, _handle: ChunkHandle) -> DriverResult<()> { unimplemented!() }
    fn map(&self, _va: DevicePtr, _size: usize, _handle: ChunkHandle) -> DriverResult<()> { unimplemented!() }
    fn set_access(&self, _va: DevicePtr, _size: usize) -> DriverResult<()> { unimplemented!() }
    fn unmap(&self, _va: DevicePtr, _size: usize) -> DriverResult<()> { unimplemented!() }
    fn write(&self, _dst: DevicePtr, _src: &[u8]) -> DriverResult<()> { unimplemented!() }
    fn read(&self, _src: DevicePtr, _dst: &mut [u8]) -> DriverResult<()> { unimplemented!() }
    fn create_stream(&self) -> DriverResult<StreamHandle> { unimplemented!() }
    fn destroy_stream(&self, _stream: StreamHandle) -> DriverResult<()> { unimplemented!() }
    fn create_event(&self) -> DriverResult<EventHandle> { unimplemented!() }
    fn record_event(&self, _event: EventHandle, _stream: StreamHandle) -> DriverResult<()> { unimplemented!() }
    fn event_done(&self, _event: EventHandle) -> DriverResult<bool> { unimplemented!() }
    fn destroy_event(&self, _event: EventHandle) -> DriverResult<()> { unimplemented!() }
}
