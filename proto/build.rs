//! Compiles `handoff/v1/*.proto` with protox (a pure-Rust protobuf compiler), so no system
//! `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "handoff/v1/common.proto",
        "handoff/v1/generate.proto",
        "handoff/v1/scheduler.proto",
        "handoff/v1/prefill.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
