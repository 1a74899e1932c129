//! Multiversioning for plain-Rust kernels: [`multiversion!`] compiles one body three times,
//! for the baseline, with AVX2 + FMA + F16C (most laptops and older servers: no AVX-512) and
//! with AVX-512, and picks one at run time. Rust never contracts `a * b + c` into an FMA on
//! its own and `mul_add` is fused in every version (in hardware, or by libm on the
//! baseline), so all versions compute bit-identical results; only the speed differs.
//! Helpers called from the body must be `#[inline(always)]` so they are compiled inside the
//! feature-enabled copy.

/// `multiversion! { fn name(args) { body } }` defines `fn name(args)`.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
                fn avx512($($arg: $ty),*) $body
                let isa = $crate::cpu::Isa::detect();
                if isa.has_avx512() {
                    // SAFETY: the features were detected at run time.
                    return unsafe { avx512($($arg),*) };
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                fn avx2($($arg: $ty),*) $body
                if isa.has_avx2() {
                    // SAFETY: the features were detected at run time.
                    return unsafe { avx2($($arg),*) };
                }
            }
            fn portable($($arg: $ty),*) $body
            portable($($arg),*)
        }
    };
}

pub(crate) use multiversion;
