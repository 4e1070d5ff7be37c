//! Compiles the C++ front of the allocation entry point that PyTorch's global allocator uses: it
//! turns a failed allocation into a C++ exception PyTorch translates (see cxx/torch_alloc.cpp).

fn main() {
    println!("cargo:rerun-if-changed=cxx/torch_alloc.cpp");
    cc::Build::new()
        .cpp(true)
        .file("cxx/torch_alloc.cpp")
        .flag_if_supported("-std=c++17")
        .flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .compile("moonbright_torch_alloc");
}
