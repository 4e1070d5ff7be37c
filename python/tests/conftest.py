import os

# Every test in this process uses a small host-backend allocator, checked after every operation.
# (The allocator is process-wide and fixed at first use; tests that configure differently run
# in a subprocess.)
HOST_CONF = "backend:host,host_capacity:256MiB,host_page_size:64KiB,cap:8MiB,validate:true"
os.environ.setdefault("MOONBRIGHT_ALLOC_CONF", HOST_CONF)
