"""benchmarks/step_profile.py sums a GPU trace's kernels per step; host and other devices' events do not
count."""


def test_kernel_summary_counts_device_kernels_once():
    from benchmarks.step_profile import kernel_summary

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:CPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 4, "args": {"name": "/device:TPU:0"}}]
    kernels = [{"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": 0, "dur": 10},
               {"ph": "X", "pid": 1, "tid": 8, "name": "copy", "ts": 5, "dur": 10},  # overlaps gemm by 5
               {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": 30, "dur": 10}]
    host = [{"ph": "X", "pid": 2, "tid": 1, "name": "launch", "ts": 0, "dur": 100},
            {"ph": "X", "pid": 3, "tid": 1, "name": "cpu op", "ts": 0, "dur": 100},
            {"ph": "X", "pid": 4, "tid": 1, "name": "XLA Modules", "ts": 0, "dur": 100},
            {"ph": "i", "pid": 1, "tid": 7, "name": "marker", "ts": 1}]
    s = kernel_summary(meta + kernels + host, steps=2)
    assert s["kernels_per_step"] == 1.5
    assert s["busy_us_per_step"] == 12.5  # (15 + 10) / 2: the overlap counted once
    assert s["span_us_per_step"] == 20.0  # 0 to 40, over two steps
    assert [(k["kernel"], k["us_per_step"], k["calls_per_step"]) for k in s["top"]] == [("gemm", 10.0, 1.0),
                                                                                        ("copy", 5.0, 0.5)]
    assert kernel_summary(meta + host, steps=1)["kernels_per_step"] == 0


def test_compiler_options_parse_to_xla_types():
    import pytest

    from benchmarks.step_profile import parse_options

    assert parse_options("xla_gpu_enable_triton_gemm=false,xla_gpu_dot_merger_threshold_mb=0") == {
        "xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
    assert parse_options("") == {}
    with pytest.raises(ValueError, match="key=value"):
        parse_options("xla_gpu_enable_triton_gemm")
    # a list value (XLA's command buffer kinds) continues over the commas
    assert parse_options("xla_gpu_enable_command_buffer=FUSION,CUBLAS,WHILE,xla_gpu_autotune_level=0") == {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,WHILE", "xla_gpu_autotune_level": 0}
    with pytest.raises(ValueError, match="key=value"):
        parse_options("xla_gpu_enable_triton_gemm=false,WHILE")
