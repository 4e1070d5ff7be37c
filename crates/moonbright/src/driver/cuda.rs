//! The CUDA backend: the virtual-memory API through cudarc's `sys` layer, libcuda loaded at run time.
//! (Being written.)
