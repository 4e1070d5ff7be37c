//! The host backend: a CPU model of the CUDA virtual-memory API with real bytes.
//! (Being written: see the brief in the commit that adds it.)
