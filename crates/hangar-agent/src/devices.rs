//! The GPUs a node agent can use, counted from the machine rather than
//! configured: the NVIDIA device nodes this process sees.
//!
//! In a container the runtime creates `/dev/nvidiaN` only for the GPUs the
//! container was given — on Kubernetes, those NVIDIA's device plugin
//! allocated to the pod for its `nvidia.com/gpu` limit, whatever device
//! list strategy it uses — and CUDA numbers them from 0 in the same order,
//! which is how `CUDA_VISIBLE_DEVICES` names them to engines. On a machine
//! without a container they are all of its GPUs. (The downward API cannot
//! pass an extended resource such as `nvidia.com/gpu` to a container,
//! kubernetes/kubernetes#44552, so the count is read here.)

use std::path::Path;

/// Where device nodes live.
pub const DEV: &str = "/dev";

/// How many NVIDIA GPUs `dev` holds device nodes for: entries named
/// `nvidia` and a number (`nvidia0`, `nvidia7`), not the driver's other
/// nodes (`nvidiactl`, `nvidia-uvm`, `nvidia-modeset`, `nvidia-caps`).
pub fn nvidia_gpus(dev: &Path) -> std::io::Result<u32> {
    let mut n = 0;
    for entry in std::fs::read_dir(dev)? {
        let name = entry?.file_name();
        let is_gpu = name
            .to_str()
            .and_then(|s| s.strip_prefix("nvidia"))
            .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()));
        n += u32::from(is_gpu);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_numbered_nvidia_nodes_are_gpus() {
        let dev = tempfile::tempdir().unwrap();
        for name in [
            "nvidia0",
            "nvidia3",
            "nvidia12",
            "nvidiactl",
            "nvidia-uvm",
            "nvidia-uvm-tools",
            "nvidia-modeset",
            "nvidia",
            "null",
            "nvme0",
        ] {
            std::fs::write(dev.path().join(name), b"").unwrap();
        }
        std::fs::create_dir(dev.path().join("nvidia-caps")).unwrap();
        assert_eq!(nvidia_gpus(dev.path()).unwrap(), 3);
        assert_eq!(nvidia_gpus(tempfile::tempdir().unwrap().path()).unwrap(), 0);
        assert!(nvidia_gpus(&dev.path().join("missing")).is_err());
    }
}
