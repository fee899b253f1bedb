//! AMX (Advanced Matrix Extensions, x86-64 only): whether this process may use the tile registers.
//!
//! Three things must hold: the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), the
//! kernel manages the 8 KiB of tile state, and this process has asked for it. Linux (5.16 and later)
//! leaves tile data disabled until a process requests it with `arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`; the request succeeds only where the hardware and the kernel support it, and the
//! permission then holds for every thread of the process. It is made once, on the first query.

use std::sync::OnceLock;

/// Whether the AMX bf16 path may run in this process (asking the OS for permission on the first call).
pub(crate) fn is_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| cpu_has_amx_bf16() && os::request_tile_data())
}

fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is queried only where the CPU reports it.
    #[allow(unused_unsafe)]
    let edx = unsafe {
        if __cpuid(0).eax < 7 {
            return false;
        }
        __cpuid_count(7, 0).edx
    };
    edx & (AMX_BF16 | AMX_TILE) == AMX_BF16 | AMX_TILE
}

#[cfg(target_os = "linux")]
mod os {
    /// `ARCH_REQ_XCOMP_PERM` from `asm/prctl.h`.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    /// The XSAVE feature number of AMX tile data.
    const XFEATURE_XTILEDATA: libc::c_long = 18;

    pub(super) fn request_tile_data() -> bool {
        // SAFETY: arch_prctl with these arguments only changes which XSAVE features the process may use;
        // an older kernel answers EINVAL.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }
}

#[cfg(not(target_os = "linux"))]
mod os {
    /// Other systems: not used (Windows enables AMX without a request, but it is untested here).
    pub(super) fn request_tile_data() -> bool {
        false
    }
}
