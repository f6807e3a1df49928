//! Complex arithmetic for the expression evaluator: answers such as `1 - 12i`
//! and roots of negative values at random points need the complex plane.

/// Largest integer exponent evaluated by repeated squaring.
const MAX_INT_POW: f64 = 1024.0;

/// A complex number; answers such as `1 - 12i` and roots of negative values
/// at random points need the complex plane.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct C {
    pub re: f64,
    pub im: f64,
}

impl C {
    pub const fn real(re: f64) -> Self {
        C { re, im: 0.0 }
    }
    pub(super) const I: C = C { re: 0.0, im: 1.0 };
    pub(super) const NAN: C = C { re: f64::NAN, im: f64::NAN };

    pub fn is_finite(self) -> bool {
        self.re.is_finite() && self.im.is_finite()
    }
    pub fn norm(self) -> f64 {
        self.re.hypot(self.im)
    }
    pub(super) fn is_real(self) -> bool {
        self.im == 0.0
    }
    /// The real part when the imaginary part is negligible, for real-only functions.
    pub(super) fn as_real(self) -> Option<f64> {
        (self.im.abs() <= 1e-12 * self.re.abs().max(1.0)).then_some(self.re)
    }
    pub fn add(self, o: C) -> C {
        C { re: self.re + o.re, im: self.im + o.im }
    }
    pub fn sub(self, o: C) -> C {
        C { re: self.re - o.re, im: self.im - o.im }
    }
    pub(super) fn neg(self) -> C {
        C { re: -self.re, im: -self.im }
    }
    pub fn mul(self, o: C) -> C {
        if self.is_real() && o.is_real() {
            return C::real(self.re * o.re);
        }
        C { re: self.re * o.re - self.im * o.im, im: self.re * o.im + self.im * o.re }
    }
    pub fn div(self, o: C) -> C {
        if self.is_real() && o.is_real() {
            return C::real(self.re / o.re);
        }
        let d = o.re * o.re + o.im * o.im;
        C { re: (self.re * o.re + self.im * o.im) / d, im: (self.im * o.re - self.re * o.im) / d }
    }
    pub(super) fn exp(self) -> C {
        let m = self.re.exp();
        if self.im == 0.0 {
            return C::real(m);
        }
        C { re: m * self.im.cos(), im: m * self.im.sin() }
    }
    pub(super) fn ln(self) -> C {
        if self.is_real() && self.re > 0.0 {
            return C::real(self.re.ln());
        }
        C { re: self.norm().ln(), im: self.im.atan2(self.re) }
    }
    pub(super) fn sqrt(self) -> C {
        if self.is_real() && self.re >= 0.0 {
            return C::real(self.re.sqrt());
        }
        let r = self.norm().sqrt();
        let t = self.im.atan2(self.re) / 2.0;
        C { re: r * t.cos(), im: r * t.sin() }
    }
    pub(super) fn sin(self) -> C {
        C { re: self.re.sin() * self.im.cosh(), im: self.re.cos() * self.im.sinh() }
    }
    pub(super) fn cos(self) -> C {
        C { re: self.re.cos() * self.im.cosh(), im: -self.re.sin() * self.im.sinh() }
    }
    pub(super) fn recip(self) -> C {
        C::real(1.0).div(self)
    }
    pub(super) fn powi(self, mut n: u64) -> C {
        let (mut base, mut acc) = (self, C::real(1.0));
        while n > 0 {
            if n & 1 == 1 {
                acc = acc.mul(base);
            }
            base = base.mul(base);
            n >>= 1;
        }
        acc
    }
    /// Principal power; exact for integer exponents, real for real results.
    pub(super) fn pow(self, w: C) -> C {
        if w.is_real() && w.re.fract() == 0.0 && w.re.abs() <= MAX_INT_POW {
            if self.is_real() {
                return C::real(self.re.powf(w.re));
            }
            // Exact integer powers keep `i^2 = -1` free of rounding noise.
            let p = self.powi(w.re.abs() as u64);
            return if w.re < 0.0 { p.recip() } else { p };
        }
        if self.is_real() && w.is_real() && self.re >= 0.0 {
            return C::real(self.re.powf(w.re));
        }
        if self.re == 0.0 && self.im == 0.0 {
            return if w.re > 0.0 { C::real(0.0) } else { C::NAN };
        }
        w.mul(self.ln()).exp()
    }
}
